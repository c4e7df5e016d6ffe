"""The HTTP floor: uvicorn (uvloop, httptools, as bertserve runs it) with two worker processes,
answering every POST with a constant /classify answer. No framework, no model, no log.

    python -m bench.peers.floor --bundle bundles/sst2-distilled-2x192 --port 8130

What this costs a request (the loop's CPU, the client's, the kernel's) is what any Python server
on uvicorn pays before it does anything; `bertserve bench cpu-split` measures it beside
bertserve. Not a peer in `make bench`: it serves no model.
"""

from __future__ import annotations

import os

from bench.peers.common import parse_args

ANSWER = b'[{"label":"positive","score":0.9962}]'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


async def app(scope: dict, receive, send) -> None:
    if scope["type"] != "http":  # lifespan: nothing to start
        message = await receive()
        while message["type"] != "lifespan.shutdown":
            await send({"type": message["type"] + ".complete"})
            message = await receive()
        await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:  # the whole body, as any server must read it
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


def main() -> None:
    import uvicorn

    args = parse_args(__doc__.split("\n")[0])
    workers = int(os.environ.get("FLOOR_WORKERS", "2"))
    uvicorn.run(
        "bench.peers.floor:app",
        host="127.0.0.1",
        port=args.port,
        workers=workers,
        loop="uvloop",
        http="httptools",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
