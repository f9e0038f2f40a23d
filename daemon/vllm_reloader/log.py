"""Logging as events: one line per decision, fixed event names, fields not prose.

Off a TTY (systemd, pipes) each line is one JSON object on stdout, for journalctl and log
shippers; on a TTY it is structlog's console renderer, for people.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from typing import Any, TextIO

import structlog

# syslog priorities, which journald reads from a `<N>` line prefix (sd-daemon(3)).
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "critical": 2, "exception": 3}


REDACTED = "[redacted]"
_secrets: frozenset[str] = frozenset()
_pattern: re.Pattern[str] | None = None
_secrets_lock = threading.Lock()
_PLAIN = (int, float, bool, type(None))


def add_secret(secret: str) -> None:
    """From now on `secret` is `[redacted]` in every event, in whatever field, nested list or
    dict, exception text or traceback it arrives. Kept for the life of the process (a SIGHUP
    that changes the key keeps hiding the old one too). Its escaped forms (as `repr` writes it,
    of the text or of its bytes, as an HTTP library quotes a header; as JSON writes it) are
    hidden as well."""
    if not secret:
        return
    forms = {secret, repr(secret)[1:-1], repr(secret.encode())[2:-1], json.dumps(secret)[1:-1]} - {""}
    global _secrets, _pattern
    with _secrets_lock:
        _secrets = _secrets | forms
        # Longest first, so a form that contains another is replaced whole.
        _pattern = re.compile("|".join(re.escape(s) for s in sorted(_secrets, key=len, reverse=True)))


def forget_secrets() -> None:
    """For tests: nothing is redacted any more."""
    global _secrets, _pattern
    with _secrets_lock:
        _secrets, _pattern = frozenset(), None


def _scrub(value: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(value, str):
        return pattern.sub(REDACTED, value)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, dict):
        return {
            pattern.sub(REDACTED, k) if isinstance(k, str) else k: _scrub(v, pattern)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple | set | frozenset):
        items = [_scrub(v, pattern) for v in value]
        return items if isinstance(value, list) else tuple(items)
    # Anything else (an exception, a path, bytes, an object) is rendered later with repr() or
    # str(): when either would show a secret, the value becomes its redacted repr.
    try:
        shown = f"{value!r}\n{value!s}"
    except Exception:  # a repr that raises is the renderer's problem, not a leak
        return value
    return pattern.sub(REDACTED, repr(value)) if pattern.search(shown) else value


def redact_secrets(_logger: Any, _method: str, event_dict: Any) -> Any:
    """The processor that keeps secrets out of the log: runs after the exception is rendered
    into the event (`format_exc_info`) and before the line is, on every field."""
    pattern = _pattern
    if pattern is None:
        return event_dict
    return {key: _scrub(value, pattern) for key, value in event_dict.items()}


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
            redact_secrets,
            renderer,
            *([_priority_prefix] if priority_prefix else []),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def get() -> Any:
    return structlog.get_logger("vllm_reloader")
