"""structlog setup: JSON lines when stderr is not a terminal (systemd, files), console on a TTY.

Use `get_logger(__name__)`; `bind_version(log, version)` returns a logger whose
every line carries `version=`, so one checkpoint's processing can be grepped.
"""

from __future__ import annotations

import logging
import sys
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
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(numeric)
    # Libraries that are chatty (watchdog logs every inotify event at DEBUG): warnings only.
    for noisy in ("watchdog", "apscheduler", "uvicorn.access", "alembic", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


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
