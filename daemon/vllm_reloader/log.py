"""Logging as events: one line per decision, fixed event names, fields not prose.

Off a TTY (systemd, pipes) each line is one JSON object on stdout, for journalctl and log
shippers, `timestamp`, `level` and `event` first and no value cut; on a TTY it is structlog's
console renderer, for people, with long values cut. A reader that goes away (`run ... | head`)
stops the daemon as SIGTERM does, without a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
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


FIRST = ("timestamp", "level", "event")
"""The keys a JSON line starts with: a reader scanning lines finds when, how bad and what."""
CONSOLE_VALUE_CHARS = 300
"""On a console a value longer than this is cut (a JSON line keeps every value whole)."""
WHOLE_ON_CONSOLE = frozenset({"event", "exception", "stack"})


def first_keys_first(_logger: Any, _method: str, event_dict: Any) -> Any:
    """`FIRST`, then the event's fields in the order they were given."""
    return {
        **{key: event_dict[key] for key in FIRST if key in event_dict},
        **{key: value for key, value in event_dict.items() if key not in FIRST},
    }


def cut_long_values(_logger: Any, _method: str, event_dict: Any) -> Any:
    """For the console renderer only: a long value (a load report, a traceback's message)
    would push the line off a person's screen; the JSON line has it whole."""

    def cut(key: str, value: Any) -> Any:
        if key in WHOLE_ON_CONSOLE:
            return value
        text = value if isinstance(value, str) else repr(value)
        if len(text) <= CONSOLE_VALUE_CHARS:
            return value
        return f"{text[:CONSOLE_VALUE_CHARS]}… ({len(text)} chars)"

    return {key: cut(key, value) for key, value in event_dict.items()}


EXIT_OUTPUT_LOST = 141
"""`run`'s exit status once its log's reader went away (128 + SIGPIPE, as a shell reports a
pipe's writer): not 0, so systemd's `Restart=on-failure` brings back a daemon whose journal
stream was lost."""
_output_lost = threading.Event()


def output_lost() -> bool:
    return _output_lost.is_set()


class LineWriter:
    """structlog's logger: writes each rendered line and flushes it. When the reader of the
    stream went away (EPIPE), the stream is pointed at /dev/null (so no later write or the
    flush at exit raises, as Python's docs on SIGPIPE advise) and the process is sent SIGTERM:
    the daemon stops as under `systemctl stop`, its reload finished, the engine not left
    paused, with nothing more to say."""

    def __init__(self, stream: TextIO) -> None:
        self._stream, self._lock, self._closed = stream, threading.Lock(), False

    def msg(self, message: str) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                self._stream.write(message + "\n")
                self._stream.flush()
            except BrokenPipeError:
                self._closed = True
                _output_lost.set()
                _to_devnull(self._stream)
                os.kill(os.getpid(), signal.SIGTERM)

    debug = info = warning = warn = error = err = critical = exception = fatal = failure = log = msg


def _to_devnull(stream: TextIO) -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stream without a file descriptor: nothing to flush at exit
        pass


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
    writer = LineWriter(stream)
    as_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer: Any = structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    shaping: Any = first_keys_first if as_json else cut_long_values
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact_secrets,
            shaping,
            renderer,
            *([_priority_prefix] if priority_prefix else []),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=lambda *_args: writer,
        cache_logger_on_first_use=False,
    )


def get() -> Any:
    return structlog.get_logger("vllm_reloader")
