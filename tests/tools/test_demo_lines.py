"""What the demo prints of the daemon's events (issue 23, item 7): whole events in a short
form, never a JSON line cut mid-way, and the engine's warm-up apart from the reload. The demo
itself needs a real engine (`test_demo.py`)."""

import json

from vllm_reloader.tools import demo


def test_demo_shows_an_event_by_the_fields_that_matter_whole():
    reason = "layout: model.norm.weight: shape [2048] != serving [4096] " + "x" * 300
    line = demo.brief(
        {
            "timestamp": "2026-12-05T06:59:06Z",
            "level": "warning",
            "event": "checkpoint.rejected",
            "engine": "http://127.0.0.1:8000",
            "name": "step-2",
            "check": "layout",
            "reason": reason,
            "fingerprint": "9e8d7c6b5a4938271605f4e3d2c1b0a9",
        }
    )
    assert line.startswith("checkpoint.rejected ")
    assert "name=step-2 check=layout" in line
    assert line.endswith(f"reason={json.dumps(reason)}"), "whole, quoted: it has spaces"
    assert "fingerprint" not in line and "timestamp" not in line and "http://" not in line


def test_demo_shows_every_field_of_an_event_it_has_no_choice_for():
    line = demo.brief({"event": "engine.resumed", "level": "info", "reason": "found paused", "n": 2})
    assert line == 'engine.resumed       reason="found paused" n=2'


def test_demo_says_the_warm_up_is_not_part_of_the_reload():
    said = demo.warm_up({"event": "engine.warmed", "ms": 2412.6, "problem": None})
    assert said == "engine warm-up, once after start (not part of the reload): 2413 ms"
