"""The service's log lines: as text for a person, or one JSON object a line for a collector
(`--log-format json`), with the session and turn a line is about where it has them.

A record has them from the log call (`extra={"session": ..., "turn": ...}`) or, failing that,
from the request it was logged under (`bound`: the HTTP side binds a turn's ids when it begins;
`asyncio.to_thread` carries them into the thread it runs, a thread started by hand does not).

Every HTTP request is one line of its own logger, `shadow.access` (INFO): its method, path,
status, seconds, session and response bytes, as fields of the JSON object (`ACCESS`) and in the
text line. A refusal or failure (a 4xx, a 5xx, an error ending a stream) is one more line of
`shadow.http` with its cause (`http.guard`).

What the levels mean: DEBUG is detail for a developer; INFO is what the service decided or did
(the engine's dialect, the shadow ready, the stop, each request); WARNING is something an
operator may want to act on (a session's first mismatch with the engine, a write that failed and
will be tried again, ids skipped, a request refused); ERROR is something lost (a session that
could not be written at the stop, a model that failed to load, a request the engine or the
service failed). No log line carries a prompt's text.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

FIELDS = ("session", "turn")
ACCESS = ("method", "path", "status", "duration_s", "bytes")  # an access line's fields
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_bound: contextvars.ContextVar[dict] = contextvars.ContextVar("shadow_log_fields", default={})


def bind(**fields) -> None:
    """Name the session and turn the current request's log lines are about (None values are left out)."""
    _bound.set({**_bound.get(), **{k: v for k, v in fields.items() if v is not None}})


@contextmanager
def bound(**fields) -> Iterator[None]:
    """`bind` for a block, put back after it."""
    token = _bound.set({**_bound.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _bound.reset(token)


class BoundFields(logging.Filter):
    """Puts the bound session and turn on each record that has none of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _bound.get().items():
            if getattr(record, key, None) is None:
                setattr(record, key, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, the session and turn
    where the record has them (and an access line's fields), the exception's traceback where there
    is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key in (*FIELDS, *ACCESS):
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s: %(message)s"


def handler(fmt: str, stream=None) -> logging.Handler:
    """A stream handler (stderr by default) writing `fmt` ('text' or 'json'), bound fields included."""
    h = logging.StreamHandler(stream or sys.stderr)
    h.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    h.addFilter(BoundFields())
    return h


def setup(fmt: str, level: str = "info", stream=None) -> None:
    """The process's logging for `shadow serve`: one handler on the root logger, the project's
    loggers from `level` (debug, info, warning or error), everything else (uvicorn included: give
    it `log_config=None`) from WARNING, or `level` if higher, through the same handler; Python's
    warnings and a thread's uncaught exception become records too, so every line on the stream
    has the one format. A process whose logging is configured already (a root logger with
    handlers) keeps its handlers, as `logging.basicConfig` does; the project's level is set
    either way."""
    least = LEVELS[level]
    logging.getLogger("shadow").setLevel(least)
    root = logging.getLogger()
    if root.handlers:
        return
    root.addHandler(handler(fmt, stream))
    root.setLevel(max(least, logging.WARNING))
    logging.captureWarnings(True)
    threading.excepthook = _thread_died


def _thread_died(args) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("shadow").error("thread %s ended on an uncaught exception", name,
                                      exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
