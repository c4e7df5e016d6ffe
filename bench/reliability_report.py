"""docs/reliability.md from runs/bench/reliability.json (written by bench/reliability.py)."""

from __future__ import annotations

import json
from pathlib import Path


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def write_report(r: dict, out: Path) -> None:
    o, h, s = r["overload"], r["hostile"], r["sigterm"]
    f, st, d = r["failing_backend"], r["stalled_backend"], r["client_disconnects"]
    only_200_429 = set(o["statuses"]) <= {"200", "429"} and o["socket_errors"] == 0
    recovered = next(
        (i + 1 for i, x in enumerate(o["recovery_per_s"]) if x >= 0.9 * o["saturation"]), None
    )
    lines = [
        "# Reliability",
        "",
        "What the service promises under overload, faults and hostile input, and the figure each",
        f"check produced. Measured on {r['date']} with `make reliability` (`python -m",
        f"bench.reliability`, {r['wall_s'] / 60:.1f} min) on the machine of",
        "[benchmarks.md](benchmarks.md); raw figures in `runs/bench/reliability.json`. The checks",
        "that fit in CI run there too (see the last section).",
        "",
        "## Overload: 5x saturation, open loop",
        "",
        f"Saturation measured first (closed loop, 32 connections): **{o['saturation']:.0f} req/s**."
        f" Then Poisson arrivals at {o['offered']:.0f} req/s for {o['seconds']:.0f} s "
        f"({o['sent']} requests sent, {o['unsent']} not sent for want of a free connection "
        f"(2,048 at most); the client used {o['client_cpu_pct']:.0f}% of a core).",
        "",
        "| figure | value | promise kept |",
        "|---|---|---|",
        f"| statuses | {o['statuses']}, socket errors {o['socket_errors']} "
        f"{o.get('socket_error_kinds') or ''} | only 200 and 429: {_yes(only_200_429)} |",
        f"| p99 latency of the answered requests | {o['p99_ms'] / 1000:.1f} s | see below |",
        f"| answered 200/s during the flood | {o['answered_200_per_s']:.0f} | "
        f"{o['answered_200_per_s'] / o['saturation']:.0%} of saturation |",
        f"| server memory (RSS) | {o['rss_before_mib']:.0f} MiB before, max "
        f"{o['rss_max_mib']:.0f} MiB during, {o['rss_after_mib']:.0f} MiB after | "
        f"bounded: {_yes(o['rss_max_mib'] < o['rss_before_mib'] + 200)} |",
        f"| throughput in the 5 seconds after, 1 s each | "
        f"{', '.join(f'{x:.0f}' for x in o['recovery_per_s'])} req/s | "
        + (
            f"back to >= 90% of saturation in second {recovered} |"
            if recovered
            else "**not back to 90% within 5 s** |"
        ),
        "",
        "Why it holds: admission control counts queued sequences per model "
        "(`BERTSERVE_MAX_QUEUE_ROWS`, 512) and answers 429 with `Retry-After` past it, so the "
        "queue, and the memory behind it, cannot grow with the offered load; once a model's "
        "queue is full, requests for it are refused before their body is parsed (a 429 costs "
        "a fraction of a served request).",
        "",
        "What does not hold: latency, goodput and, at the socket level, the status promise. "
        "One Python event loop answers (200 or 429) only so many requests a second; beyond "
        "that, requests wait in the kernel's socket buffers and accept queue, before the "
        "service can see them or refuse them. The p99 above is that wait; the socket errors are "
        "the client's 30 s timeouts and connections reset while they waited, not answers the "
        "service gave; and the time spent accepting, parsing and refusing leaves less for the "
        "admitted work, so fewer 200s a second are served than at saturation. Requests not "
        "sent are arrivals that found all 2,048 client connections busy. A single process "
        "cannot refuse faster than it can parse; a proxy or ingress that caps connections per "
        "replica, more replicas (docs/deploy.md) and clients that honour Retry-After are the "
        "answer. See docs/performance.md for what one process can do.",
        "",
        "## Hostile bodies",
        "",
        "| input | answer | time |",
        "|---|---|---|",
        f"| 10 MB JSON body with Content-Length | {h['body_10mb']['status']}: "
        f"{h['body_10mb']['error']} | {1000 * h['body_10mb']['seconds']:.0f} ms |",
        f"| 10 MB body streamed without Content-Length | {h['body_10mb_chunked']['status']}: "
        f"{h['body_10mb_chunked']['error']} | "
        f"{1000 * h['body_10mb_chunked']['seconds']:.0f} ms |",
    ]
    for key, what in (
        ("text_100k_tokens", "100,000-token English-like text"),
        ("cjk_100k_tokens", "100,000 CJK characters (one token each, at the character limit)"),
    ):
        for endpoint in ("classify", "ner"):
            t = h[f"{key}_{endpoint}"]
            lines.append(
                f"| {what}, {t['chars']:,} characters, to /{endpoint} | {t['status']}: "
                f"{t['error']} | {1000 * t['seconds']:.0f} ms |"
            )
    lines += [
        "",
        f"Server memory across these requests: RSS {h['rss_before_mib']:.0f} -> "
        f"{h['rss_after_mib']:.0f} MiB, peak RSS {h['peak_before_mib']:.0f} -> "
        f"{h['peak_after_mib']:.0f} MiB. Bodies over the limit are refused while they arrive "
        "(chunked) or from their Content-Length, and a text over `BERTSERVE_MAX_TEXT_CHARS` before "
        "it is tokenised. A text under the character limit is tokenised on the event loop before "
        "the window cap (`BERTSERVE_MAX_REQUEST_ROWS`) refuses it: the CJK rows show that cost "
        "(time and the peak-RSS step); lower `MAX_TEXT_CHARS` where such texts are expected.",
        "",
        "## SIGTERM under load",
        "",
        f"Open-loop traffic at 300 req/s, every request with its own `X-Request-ID`; SIGTERM after "
        f"3 s. {s['sent']} requests were sent in 8 s; the server stops accepting, finishes what it "
        "admitted and exits. Each request id the server logged is matched against the answers "
        "the client received.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| client received | {s['client_statuses']}; socket errors {s['client_socket_errors']} "
        "(connections refused or closed after the listener shut: never admitted) |",
        f"| server logged (one line per admitted request) | {s['server_logged']}: "
        f"{s['server_logged_statuses']} |",
        f"| admitted but never answered to the client | {len(s['logged_not_received'])} |",
        f"| answered but not logged / status differs | {len(s['received_not_logged'])} / "
        f"{s['status_mismatch']} |",
        f"| exit | code {s['exit_code']}, {s['exit_s']:.1f} s after the signal |",
        "",
        "503s are requests that arrived on open connections during the drain: answered, with "
        "`unavailable`, so the client can retry elsewhere.",
        "",
        "## Injected faults (engine wrapped in a real server)",
        "",
        "| fault | figure | promise kept |",
        "|---|---|---|",
        f"| backend fails {f['fail_rate']:.0%} of model calls, 16 connections, 10 s | "
        f"{f['failed_calls']} of {f['calls']} calls failed, holding {f['failed_rows']} rows; "
        f"clients saw {f['statuses']} | only those batches failed (500s = failed rows): "
        f"{_yes(f['only_failed_batches_failed'])} |",
        f"| backend stalls 3 s a call, deadline 1 s, queue limit 64, 128 connections | "
        f"{st['statuses']}; deepest queue {st['max_depth_seen']} rows | 504 past the deadline, "
        f"429 past the limit, queue bounded: {_yes(st['max_depth_seen'] <= st['max_queue_rows'])}"
        f"; after the stall {st['after_statuses']} ({st['after_per_s']:.0f} req/s) |",
        f"| {d['hung_up']} clients send and hang up while the model is busy | "
        f"{d['rows_computed_after']} rows computed for them, {d['dropped_cancelled']:.0f} rows "
        f"dropped as cancelled | no compute for a client whose hang-up the server has read when "
        f"the batch forms: {_yes(d['rows_computed_after'] <= 0.05 * d['hung_up'])} (a row batched "
        "in the instant before its hang-up is read still runs) |",
        "",
        "## In CI (tests/service)",
        "",
        "- `test_fuzz.py`: schemathesis generates requests for every endpoint from the service's "
        "own OpenAPI schema; no 5xx, every answer valid against the schema.",
        "- `test_behaviour.py`: 429 with Retry-After at the admission limit, and before the body "
        "is parsed once the queue is full; a cancelled request costs no inference (and logs no "
        "asyncio error); a failed backend call fails only its batch; a stalled backend gives "
        "504; a dead batching loop is restarted; 413 for bodies over the limit (declared or "
        "chunked) and for texts needing more windows than `MAX_REQUEST_ROWS`; 422 for non-UTF-8.",
        "- `test_process.py`: SIGTERM with queued requests in a real process: all answered, a "
        "late one 503, exit 0.",
        "- `tests/bench/`: the load generators and the peers' model extraction.",
        "",
    ]
    out.write_text("\n".join(lines))


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", type=Path, default=Path("runs/bench/reliability.json"))
    parser.add_argument("--out", type=Path, default=Path("docs/reliability.md"))
    args = parser.parse_args()
    write_report(json.loads(args.results.read_text()), args.out)


if __name__ == "__main__":
    main()
