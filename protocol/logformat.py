"""How peers and validators write their log: timestamped human lines, or one JSON object per line.

``--log-format json`` (``sparseloco-peer join``, ``sparseloco-validator run``) turns both the
:mod:`protocol.events` records and Python ``logging`` records (warnings included) into JSON lines
with the same fixed fields, for a log collector::

    {"time": "2025-01-31T12:00:03.120Z", "level": "info", "logger": "sparseloco.validator",
     "event": "window_published", "message": "window 3 published: …", "window": 3, "accepted": 3, …}
    {"time": "…", "level": "warning", "logger": "validator.node", "event": "log", "message": "…"}

``time`` is ISO 8601 UTC, ``level`` one of debug, info, warning, error, critical; ``event`` the event kind
(``log`` for a plain log record); the event's own fields follow (its unix ``time`` is ``time``).
``--log-format human`` (the default) prefixes every line, log records too, with the local time.

    setup_logging("json", verbose=False, stream=sys.stderr)   # Python logging records
    sink = JsonLogLines(sys.stdout, role="validator")          # an event sink
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import IO, Any

from protocol.events import (
    CheckpointSkipped,
    Event,
    Failed,
    GrantDenied,
    Resynced,
    StoreErrors,
    StoreObjectRejected,
    SyncFailed,
    WindowRetry,
    describe,
)

__all__ = ["FORMATS", "JsonFormatter", "JsonLogLines", "event_record", "plain_text", "setup_logging"]

FORMATS = ("human", "json")
HUMAN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_WARNINGS = (
    Failed,
    GrantDenied,
    Resynced,
    SyncFailed,
    WindowRetry,
    CheckpointSkipped,
    StoreObjectRejected,
    StoreErrors,
)


def iso_time(unix_s: float) -> str:
    """``unix_s`` as ISO 8601 UTC with milliseconds."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix_s)) + f".{int(unix_s * 1000) % 1000:03d}Z"


def plain_text(markup: str) -> str:
    """A :func:`protocol.events.describe` line without its rich markup."""
    from rich.text import Text

    return Text.from_markup(markup).plain


def event_record(event: Event, *, role: str) -> dict[str, Any]:
    """The JSON log object of ``event`` (see the module docstring)."""
    fields = {k: v for k, v in dataclasses.asdict(event).items() if k != "time"}
    return {
        "time": iso_time(event.time),
        "level": "warning" if isinstance(event, _WARNINGS) else "info",
        "logger": f"sparseloco.{role}",
        "event": event.kind,
        "message": plain_text(describe(event)),
        **fields,
    }


class JsonLogLines:
    """An event sink writing :func:`event_record` lines to ``stream`` (flushed; thread-safe)."""

    def __init__(self, stream: IO[str], *, role: str) -> None:
        self.stream, self.role = stream, role
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        line = json.dumps(event_record(event, role=self.role), allow_nan=True, default=str) + "\n"
        with self._lock:
            self.stream.write(line)
            self.stream.flush()


def level_name(levelno: int) -> str:
    """debug, info, warning, error or critical: fixed names (a library may rename the levels
    ``logging`` prints, as hivemind does with ``WARN``)."""
    for threshold, name in ((logging.CRITICAL, "critical"), (logging.ERROR, "error"), (logging.WARNING, "warning")):
        if levelno >= threshold:
            return name
    return "info" if levelno >= logging.INFO else "debug"


class JsonFormatter(logging.Formatter):
    """A ``logging`` record as a JSON line with the fixed fields (``event`` is ``log``)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        body = {
            "time": iso_time(record.created),
            "level": level_name(record.levelno),
            "logger": record.name,
            "event": "log",
            "message": message,
        }
        return json.dumps(body, default=str)


def setup_logging(log_format: str, *, verbose: bool, stream: IO[str]) -> None:
    """Route Python logging (and ``warnings``) to ``stream``: timestamped human lines, or JSON."""
    handler = logging.StreamHandler(stream)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(HUMAN_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    # The commands' own messages (``sparseloco.*`` loggers) are worth reading without --verbose.
    logging.getLogger("sparseloco").setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.captureWarnings(True)
