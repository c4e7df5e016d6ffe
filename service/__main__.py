"""`python -m service --bundles DIR [--host H] [--port P]`: serve the bundles in DIR.

Every setting is also an environment variable with the `BERTSERVE_` prefix (flags win). On
SIGTERM (or Ctrl-C) the service stops admitting work (503, readiness false), finishes every
admitted request within BERTSERVE_DRAIN_TIMEOUT_S, then exits; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from types import FrameType

import uvicorn
from pydantic import ValidationError

from service.protocol import guarded_protocol


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        base = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)  # structured lines: log.info(..., extra=)
        if fields is not None:
            return json.dumps(base | fields)
        return json.dumps(
            base
            | {"message": message}
            | ({"exc": self.formatException(record.exc_info)} if record.exc_info else {})
        )


# One first request a task: the line a person copies from the ready message.
FIRST_REQUESTS = {
    "classify": {"inputs": "a charming and often affecting journey"},
    "ner": {"inputs": "Angela Merkel met Emmanuel Macron in Paris."},
    "qa": {
        "inputs": {
            "question": "Where was Aristotle born?",
            "context": "Aristotle was born in Stagira in 384 BC.",
        }
    },
    "fill-mask": {"inputs": "Paris is the [MASK] of France."},
    "nsp": {"inputs": {"text": "I went to the bakery.", "text_pair": "I bought fresh bread."}},
}


def ready_facts(state, host: str, port: int) -> dict:
    """What a person needs once the service is ready: where it is, what it serves, on what."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown}:{port}"
    serving = state.serving()
    task = "classify" if "classify" in serving else next(iter(serving))
    body = json.dumps(FIRST_REQUESTS.get(task, {"inputs": "hello"}))
    return {
        "event": "ready",
        "url": url,
        "listening": f"{host}:{port}",
        "docs": f"{url}/docs",
        "models": serving,
        "providers": sorted({m.engine.provider for m in state.models.values()}),
        "example": f"curl -s {url}/{task} -H 'content-type: application/json' -d '{body}'",
    }


def ready_text(facts: dict) -> str:
    width = max(len("API docs"), *map(len, facts["models"]))
    lines = [
        f"bertserve is ready at {facts['url']} (listening on {facts['listening']})",
        f"  {'API docs':<{width}}  {facts['docs']}",
        f"  {'provider':<{width}}  {', '.join(facts['providers'])}",
        *(
            f"  {task:<{width}}  {names[0]} (default)"
            + (f", {', '.join(names[1:])} (?model=NAME)" if names[1:] else "")
            for task, names in facts["models"].items()
        ),
        f"  {'try':<{width}}  {facts['example']}",
    ]
    return "\n".join(lines)


class DrainingServer(uvicorn.Server):
    """uvicorn, with a first SIGTERM that drains instead of cutting in-flight requests, and a
    line for people (or one structured log line, off a terminal) once every model is warm."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            self._announcing = asyncio.get_running_loop().create_task(self._announce())

    async def _announce(self) -> None:
        while not self.state.ready:
            if self.should_exit or self.state.draining:
                return
            await asyncio.sleep(0.05)
        port = self.servers[0].sockets[0].getsockname()[1]  # the real one, also for --port 0
        facts = ready_facts(self.state, self.config.host, port)
        if sys.stdout.isatty():
            print(ready_text(facts), flush=True)  # noqa: T201
        else:
            logging.getLogger("service").info("ready", extra={"fields": facts})

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.state.draining or self._loop is None:
            return super().handle_exit(sig, frame)
        self.state.draining = True
        logging.getLogger("service").info(
            "signal %d: draining %d in-flight requests", sig, self.state.in_flight
        )
        loop = self._loop
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = True


EXAMPLES = """examples:
  {prog} --bundles bundles                      # http://127.0.0.1:8000/docs
  {prog} --bundles bundles --host 0.0.0.0 --port 8080
  BERTSERVE_API_KEYS=k1-long-enough-key {prog} --bundles bundles
"""


LOOPBACK = ("127.0.0.1", "::1", "localhost")


def warn_if_exposed(settings) -> None:
    """Loud, not fatal: inside a container the process always listens on 0.0.0.0, and whether
    that is exposed is the port mapping's or the NetworkPolicy's call (docs/security.md)."""
    if settings.host not in LOOPBACK and not settings.keys():
        logging.getLogger("service").warning(
            "listening on %s without an API key: anyone who can reach port %d can use the "
            "models; set BERTSERVE_API_KEYS, or keep the port private (docs/security.md)",
            settings.host,
            settings.port,
        )


def main(argv: list[str] | None = None, prog: str = "python -m service") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        epilog=EXAMPLES.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--bundles", type=Path, help="bundle directory (BERTSERVE_BUNDLES)")
    parser.add_argument("--host", help="listen address (BERTSERVE_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (BERTSERVE_PORT, default 8000; 0: any free)")
    args = parser.parse_args(argv)

    from service.app import create_app
    from service.settings import Settings

    try:
        settings = Settings(**{k: v for k, v in vars(args).items() if v is not None})
    except ValidationError as exc:
        for error in exc.errors():
            name = "BERTSERVE_" + "_".join(str(p) for p in error["loc"]).upper()
            print(f"error: {name}: {error['msg']}", file=sys.stderr)  # noqa: T201
        return 2
    from service.bundle import BUNDLE_FILE, BundleError, load_bundle_spec

    try:  # fail fast, in one line, on a bad bundle (the lifespan would say it in a traceback)
        found = sorted(settings.bundles.glob(f"*/{BUNDLE_FILE}"))
        if not found:
            raise BundleError(f"{settings.bundles}: no bundles (no */{BUNDLE_FILE})")
        for path in found:
            load_bundle_spec(path.parent)
    except BundleError as exc:
        print(f"error: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler], force=True)

    warn_if_exposed(settings)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        http=guarded_protocol(settings.header_timeout_s),
        access_log=False,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
    )
    server = DrainingServer(config, app.state.service, settings.drain_timeout_s)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
