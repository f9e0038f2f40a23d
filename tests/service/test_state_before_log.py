"""A decision is in the record store before any of its log lines: whoever reads the store on
such a line (an operator's script, a test) finds the decision there (issue 22, item 10)."""

from __future__ import annotations

import pytest
import structlog

from tests.support.fake_engine import FakeEngine, error
from vllm_reloader.service import state


@pytest.mark.parametrize("fault, line", [("canary", "reload.rolled_back"), ("reload", "reload.failed")])
def test_a_rejection_is_in_the_state_file_when_its_lines_are_logged(
    fault, line, start, root, tmp_path, make_checkpoint
):
    at_line: dict[str, dict] = {}

    def read_state_file(_logger: object, _method: str, event: dict) -> dict:
        """Runs in the daemon's thread as each line is logged: what a reader of the line finds."""
        about_step_2 = "step-2" in (event.get("version"), event.get("name"))
        if about_step_2 and event["event"] in (line, "checkpoint.rejected"):
            at_line[event["event"]] = state.load(tmp_path / "state").model_dump(mode="json")
        return event

    # Before the daemon binds its loggers; the `start` fixture's capture_logs restores the config.
    structlog.configure(processors=[read_state_file, *structlog.get_config()["processors"]])
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    if fault == "canary":
        engine.garbage.add(str(root / "step-2"))  # loads, then answers NaN
    else:
        engine.fail[f"reload:{root / 'step-2'}"] = error(500, "meta tensors")
    running = start(engine)
    running.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root, seed=2)
    running.wait_for("checkpoint.rejected", name="step-2")
    running.wait_for(line, version="step-2")
    assert set(at_line) == {line, "checkpoint.rejected"}
    for name, saved in at_line.items():
        assert "step-2" in saved["rejected"], f"{name} was logged before the state file held the rejection"
        assert saved["serving"]["version"] == "step-1", name


def test_what_a_reconciled_engine_serves_is_in_the_state_file_when_engine_reconciled_is_logged(
    start, root, tmp_path, make_checkpoint
):
    at_line: list[dict] = []

    def read_state_file(_logger: object, _method: str, event: dict) -> dict:
        if event["event"] == "engine.reconciled":
            at_line.append(state.load(tmp_path / "state").model_dump(mode="json"))
        return event

    structlog.configure(processors=[read_state_file, *structlog.get_config()["processors"]])
    make_checkpoint("step-1", step=1, root=root)
    running = start(FakeEngine(startup=str(root / "step-1")))
    running.wait_for("engine.reconciled")
    assert (at_line[0]["serving"] or {}).get("version") == "step-1"
