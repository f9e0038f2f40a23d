"""The log lines as their readers get them: a JSON line for machines that starts with when,
how bad and what, every value whole; a console line for people with long values cut (issue
23, item 7). Through the real logging setup (`capture_logs` would replace the processors).
A reader going away is `test_cli.py`'s (a real pipe)."""

from __future__ import annotations

import io
import json

from vllm_reloader import log

LONG = "x" * (log.CONSOLE_VALUE_CHARS + 50)


class Console(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_start_with_timestamp_level_event_and_keep_the_fields_order():
    stream = io.StringIO()
    log.configure(fmt="json", stream=stream)
    log.get().warning("engine.unreachable", url="http://e", reason="refused", retry_in_s=1.0)
    line = json.loads(stream.getvalue())
    assert list(line) == ["timestamp", "level", "event", "url", "reason", "retry_in_s"]
    assert (line["level"], line["event"]) == ("warning", "engine.unreachable")


def test_json_lines_keep_long_values_and_tracebacks_whole():
    stream = io.StringIO()
    log.configure(fmt="json", stream=stream)
    try:
        raise ValueError(LONG)
    except ValueError:
        log.get().exception("daemon.crashed", reason=LONG, load={"ranks": [LONG]})
    line = json.loads(stream.getvalue())
    assert line["reason"] == LONG and line["load"] == {"ranks": [LONG]}
    assert list(line)[:3] == ["timestamp", "level", "event"] and list(line)[-1] == "exception"
    assert f"ValueError: {LONG}" in line["exception"]


def test_json_lines_still_hide_a_secret_after_reordering():
    stream = io.StringIO()
    log.add_secret("sk-secret-1234")
    try:
        log.configure(fmt="json", stream=stream)
        log.get().info("engine.error", reason="header Bearer sk-secret-1234")
    finally:
        log.forget_secrets()
    assert json.loads(stream.getvalue())["reason"] == "header Bearer [redacted]"


def test_console_lines_cut_long_values_and_say_how_long_they_were():
    stream = Console()
    log.configure(fmt="auto", stream=stream)
    log.get().info("reload.succeeded", version="step-2", load={"report": LONG}, reason=LONG)
    text = stream.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    assert "version" in text and "step-2" in text
    assert LONG not in text
    assert f"… ({len(LONG)} chars)" in text
    assert len(text) < 3 * log.CONSOLE_VALUE_CHARS
