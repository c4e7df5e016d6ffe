"""docs/reports/reliability.md from runs/bench/reliability.json (written by
bench/reliability.py)."""

from __future__ import annotations

import json
from pathlib import Path


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _late(o: dict) -> str:
    """The answers over 1 s by the second of the flood they were sent in, busiest first."""
    late = o.get("late_by_second") or {}
    if not late:
        return "none"
    top = sorted(late.items(), key=lambda kv: -kv[1])[:6]
    shown = ", ".join(f"second {k}: {v}" for k, v in sorted(top, key=lambda kv: int(kv[0])))
    rest = sum(late.values()) - sum(v for _, v in top)
    return shown + (f", {rest} in {len(late) - len(top)} other seconds" if rest else "")


def _late_parts(o: dict) -> str:
    """Where the late answers' time went, as the load generator split it (median ms)."""
    parts = o.get("late_parts_ms") or {}
    if not parts.get("n"):
        return ""
    return (
        f" ({parts['on_new_connections']} of {parts['n']} on connections opened for them; "
        f"median ms in the client before sending {parts['client_lag'][0]}, connecting "
        f"{parts['connect'][0]}, from the request's write to its answer {parts['exchange'][0]})"
    )


def write_report(r: dict, out: Path) -> None:
    o, h, s = r["overload"], r["hostile"], r["sigterm"]
    f, st, d = r["failing_backend"], r["stalled_backend"], r["client_disconnects"]
    answered = sum(o["statuses"].values())
    only_http = set(o["statuses"]) <= {"200", "429", "503"} and o["socket_errors"] == 0
    by_status = o.get("by_status", {})
    recovered = next(
        (i + 1 for i, x in enumerate(o["recovery_per_s"]) if x >= 0.9 * o["saturation"]), None
    )
    lines = [
        "# Reliability",
        "",
        "What the service promises under overload, faults and hostile input, and the figure each",
        f"check produced. Measured at commit {r.get('commit', 'unrecorded')} on {r['date']} "
        "with `bertserve bench reliability "
        f"{r.get('bundles', '').strip()}` ({r['wall_s'] / 60:.1f} min; `make reliability` runs "
        "it on",
        "the student, `make reliability-minilm` on the MiniLM bundles) on the machine of",
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
        f"{o.get('socket_error_kinds') or ''} | only HTTP answers (200, or 429/503 with "
        f"Retry-After): {_yes(only_http)} |",
        f"| answers later than 1 s | {o['over_1s']} of {answered} "
        f"({o['over_1s'] / max(1, answered):.2%}); p99 {o['p99_ms'] / 1000:.2f} s, max "
        f"{o['max_ms'] / 1000:.1f} s | every answer within 1 s: "
        f"{_yes(o['over_1s'] == 0)} |",
        *(
            f"| latency of the {k}s | p50 {v['p50_ms']:.0f} ms, p99 {v['p99_ms']:.0f} ms, max "
            f"{v['max_ms'] / 1000:.1f} s; {v['over_1s']} over 1 s | |"
            for k, v in by_status.items()
        ),
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
        "How: refusals are made by the HTTP protocol itself (service/http/protocol.py), from the "
        "request line and headers, before a request becomes an ASGI task: a pre-encoded 503 "
        "(in-flight cap `BERTSERVE_MAX_IN_FLIGHT`, connection cap `BERTSERVE_MAX_CONNECTIONS`) or "
        "429 (every model for the path is full: `BERTSERVE_MAX_QUEUE_ROWS` sequences, or more "
        "than `BERTSERVE_MAX_QUEUE_WAIT_MS` of work at the rate the model has been draining its "
        "queue), with `Retry-After`, on a connection that stays open, after "
        "`BERTSERVE_REFUSAL_DELAY_MS` (50 ms: clients that retry at once cannot make refusing "
        "most of the work). One worker can refuse about "
        "30,000 requests a second this way (wrk, 64 connections, everything refused, measured "
        "without the delay), so the "
        "loop keeps up with the flood and the admitted work still runs; the queue, and the "
        "memory behind it, cannot grow with the offered load.",
        "",
        "What bounds the tail: each worker is one event loop, and with a thousand client "
        "connections busy per worker a loop turn handles every ready one, so an admitted "
        "request's answer waits for the loop as well as for the model. Under this flood a loop "
        "completes about 500 admitted requests a second, so the in-flight cap "
        "(`BERTSERVE_MAX_IN_FLIGHT`, 64 a process) is what bounds a served request's time, to "
        "about 0.1 s at the median (docs/performance.md). The queue's own bounds "
        "(`BERTSERVE_MAX_QUEUE_WAIT_MS` of work at admission; `BERTSERVE_MAX_QUEUE_TIME_MS`, "
        "750 ms, for when a request's first call would end, past which it gets 429 without "
        "running) keep a served request's queue wait and first call under 1 s. The answers "
        "still later than 1 s, by the second of the flood they were "
        f"sent in: {_late(o)}{_late_parts(o)}. A storm of new connections in the flood's "
        "first second would wait in the kernel's accept queue (libuv, under uvloop, accepts "
        "one connection per event-loop iteration); each worker takes its share of that queue "
        "each time the socket is ready (`ACCEPT_BURST` in service/process/server.py).",
        "",
        "Socket errors: a client that reuses a connection the instant the server's idle "
        "timer closes it has its request reset. The service keeps idle connections "
        "`BERTSERVE_KEEP_ALIVE_S` (75 s, longer than this run); clients and proxies whose idle "
        "timeout is below it never race the close (docs/deploy.md). The load generator labels "
        "each socket error fresh or reused, with the idle time before the reuse. "
        "Refused requests are counted (`bertserve_requests_total`, "
        "`bertserve_errors_total`) but get no access-log line: at this rate the log would cost "
        "more than the refusal. The client is `bench/loadgen/openloop.py` (asyncio.Protocol, "
        "uvloop), which offers this rate on less than half a core.",
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
        f"3 s. {s['sent']} requests were sent in 8 s. The workers finish what they admitted "
        "while new requests get 503 with `Connection: close`; then each takes the kernel's "
        "accept queue, answers it the same way, and closes the listener last. Each request id "
        "the server logged is matched against the answers the client received.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| client received | {s['client_statuses']} |",
        f"| connections refused: nothing listening any more (after the exit; never admitted, "
        f"safe to retry elsewhere) | {s.get('connections_refused', '-')} |",
        f"| connections reset or cut with a request on them | {s.get('broken', '-')} of "
        f"{s['sent']} ({s.get('broken', 0) / max(1, s['sent']):.2%}; target at most 1%) |",
        f"| server logged (one line per admitted request) | {s['server_logged']}: "
        f"{s['server_logged_statuses']} |",
        f"| admitted but never answered to the client | {len(s['logged_not_received'])} |",
        f"| answered but not logged / status differs | {len(s['received_not_logged'])} / "
        f"{s['status_mismatch']} (503s refused by the protocol while draining: "
        f"{s.get('refused_by_protocol', 0)}, never admitted) |",
        f"| exit | code {s['exit_code']}, {s['exit_s']:.1f} s after the signal |",
        "",
        "In a cluster the endpoint is removed from the Service while this happens, so the "
        "requests that found nothing listening here go to another replica (docs/deploy.md).",
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
        "- `test_fuzz.py`: schemathesis generates requests for every endpoint from the OpenAPI "
        "document the running service serves; no 5xx, every answer valid against the schema, "
        "every body the schema forbids refused and every body it allows accepted.",
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
    parser.add_argument("--out", type=Path, default=Path("docs/reports/reliability.md"))
    args = parser.parse_args()
    write_report(json.loads(args.results.read_text()), args.out)


if __name__ == "__main__":
    main()
