"""Logging as events: one line per decision, fixed event names, fields not prose.

Off a TTY (systemd, pipes) each line is one JSON object on stdout, for journalctl and log
shippers; on a TTY it is structlog's console renderer, for people.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog


def configure(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    as_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def get() -> Any:
    return structlog.get_logger("vllm_reloader")
