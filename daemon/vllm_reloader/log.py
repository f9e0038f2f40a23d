"""Logging as events: one line per decision, fixed event names, fields not prose.

Off a TTY (systemd, pipes) each line is one JSON object on stdout, for journalctl and log
shippers; on a TTY it is structlog's console renderer, for people.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

# syslog priorities, which journald reads from a `<N>` line prefix (sd-daemon(3)).
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "critical": 2, "exception": 3}


def _priority_prefix(_logger: Any, method: str, line: Any) -> str:
    """Runs after the renderer, so it receives the rendered line, not the event dict."""
    return f"<{PRIORITY.get(method, 6)}>{line}"


def configure(
    level: str = "info",
    fmt: str = "auto",
    stream: TextIO | None = None,
    *,
    priority_prefix: bool = False,
) -> None:
    """`priority_prefix` puts `<N>` before each line, so `journalctl -p warning` filters by
    level while `journalctl -o cat` still shows the JSON."""
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
            *([_priority_prefix] if priority_prefix else []),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def get() -> Any:
    return structlog.get_logger("vllm_reloader")
