"""structlog setup: JSON lines when stderr is not a terminal (systemd, files), console on a TTY.

Use `get_logger(__name__)`; `bind_version(log, version)` returns a logger whose
every line carries `version=`, so one checkpoint's processing can be grepped.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(level: str = "info", *, stream: TextIO | None = None, json: bool | None = None) -> None:
    """Route structlog and stdlib logging to `stream` (stderr); JSON unless it is a TTY."""
    stream = stream or sys.stderr
    use_json = (not stream.isatty()) if json is None else json
    numeric = _LEVELS.get(level.lower(), logging.INFO)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info if use_json else _identity,
            renderer,
        ],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(numeric)
    # Libraries that are chatty (watchdog logs every inotify event at DEBUG): warnings only.
    for noisy in ("watchdog", "apscheduler", "uvicorn.access", "alembic", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class RepeatFilter(logging.Filter):
    """At most `burst` identical lines (logger, level, every field but the time) per `window_s`;
    the next one after a window says how many were dropped. A tight loop of one failure (asyncio's
    accept() under file-descriptor exhaustion wrote 82,946 lines in 7 s) stays a few lines."""

    def __init__(self, burst: int = 5, window_s: float = 10.0) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._seen: dict[tuple[str, int, str], list[float]] = {}  # key -> [window start, count, dropped]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        # the whole line but its time: one check's seven "check" lines differ in their fields
        event = repr(sorted((k, v) for k, v in msg.items() if k != "timestamp")) if isinstance(msg, dict) else str(msg)
        key = (record.name, record.levelno, event[:300])
        now = time.monotonic()
        with self._lock:
            if len(self._seen) > 10_000:
                self._seen.clear()  # a flood of distinct lines is not what this guards against
            start, count, dropped = self._seen.get(key, [now, 0, 0])
            if now - start >= self.window_s:
                start, count = now, 0
            count += 1
            if count > self.burst:
                self._seen[key] = [start, count, dropped + 1]
                return False
            self._seen[key] = [start, count, 0]
        if dropped:
            if isinstance(msg, dict):
                msg["repeats_dropped"] = int(dropped)
            else:
                record.msg = f"{msg} ({int(dropped)} more like it were dropped)"
        return True


def _identity(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    return event


def get_logger(name: str | None = None, **bound: Any) -> structlog.stdlib.BoundLogger:
    log: structlog.stdlib.BoundLogger = structlog.get_logger(name)
    return log.bind(**bound) if bound else log


def bind_version(
    log: structlog.stdlib.BoundLogger, version: str, **extra: Any
) -> structlog.stdlib.BoundLogger:
    """A logger whose every line names the checkpoint version being processed."""
    return log.bind(version=version, **extra)
