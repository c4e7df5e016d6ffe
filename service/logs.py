"""The log format: one JSON object a line, with the access log's structured fields as they are
(`log.info(..., extra={"fields": ...})`)."""

from __future__ import annotations

import logging

import orjson


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        base = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)  # structured lines: log.info(..., extra=)
        if fields is not None:  # the access log: a line a request, so orjson
            return orjson.dumps(base | fields, default=str).decode()
        return orjson.dumps(
            base
            | {"message": message}
            | ({"exc": self.formatException(record.exc_info)} if record.exc_info else {}),
            default=str,
        ).decode()


def configure_logging(level: str) -> None:
    # The format reads none of a record's caller, thread or process fields; logging computes
    # them for every line unless told not to (the logging HOWTO's "Optimization"). Walking the
    # stack for the caller was most of an access-log line's cost on the event loop.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
