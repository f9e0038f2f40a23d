"""The session's real CPU vLLM engine and the daemon driving it, shared by the end-to-end
tests: `World` knows what the engine serves and how it must answer.

The engine starts on ROOT/step-1 (weights "A"). Its first answers are the reference for a
fresh engine on A. Checkpoints published later are copies of A or of B (other random
weights, same layout) — or C, bytes a writer may put over them — so after each reload the
answers can be compared with a fresh engine's on the same bytes, and a bad checkpoint must
leave the answers untouched. Both processes hold at `VLLM_RELOADER_FAILPOINT_DIR` failpoints
(`World.holds`) when a test asks.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.checkpoints import write_manifest
from tests.support.engine_fixtures import DaemonProcess, Engine, daemon_config, session_engine

_steps = itertools.count(2)


def list_files(staged: Path, version: str, *, step: int) -> dict[str, object]:
    """Write the manifest of a checkpoint staged under a dot-name it will be renamed from."""
    return write_manifest(staged, step=step, overrides={"version": version})


class World:
    def __init__(
        self, engine: Engine, root: Path, staging: Path, daemon: DaemonProcess, config: Path
    ) -> None:
        self.engine, self.root, self.staging, self.daemon = engine, root, staging, daemon
        self.config = config
        self.fresh_a = engine.complete()  # before any reload: a freshly started engine on A
        self.expected = self.fresh_a
        self.outputs_b: list[str] | None = None  # B's answers, once a test has loaded B
        self.serving = "step-1"
        self.holds = engine.holds
        self.highest = 1
        """The highest step handed out: above anything served, wherever it came from."""

    def stage(self, weights: str) -> tuple[str, Path]:
        """Copy checkpoint A or B into an ignored dot-dir of the root, ready to rename."""
        name = f"step-{next(_steps)}"
        target = self.root / f".stage-{name}"
        shutil.copytree(self.staging / {"A": "seed-1", "B": "seed-2", "C": "seed-3"}[weights], target)
        return name, target

    def publish(self, weights: str, *, step: int | None = None) -> str:
        """Publish A, B or C; by default with a step above what is served, so it loads."""
        name, staged = self.stage(weights)
        step = step or _next_step_above_serving(self)
        self.highest = max(self.highest, step)
        list_files(staged, name, step=step)
        staged.rename(self.root / name)
        return name

    def start_daemon(self) -> None:
        """The world's daemon again, after a test drove the engine with its own: whatever that
        one loaded is outside this root, so every checkpoint here is newer; A is published
        as the newest, and served once loaded."""
        self.daemon = DaemonProcess(self.config, env={"VLLM_RELOADER_FAILPOINT_DIR": str(self.holds)})
        self.daemon.wait_for("engine.reconciled", version=self.serving)
        back = self.publish("A", step=max(3 * 10**6, self.highest) + next(_steps))
        self.daemon.wait_for("reload.succeeded", version=back, timeout=120)
        self.serving, self.expected = back, self.fresh_a

    def assert_unchanged(self) -> None:
        assert self.engine.healthy()
        assert not self.engine.is_paused()
        assert self.engine.weight_version() == self.serving
        assert self.engine.complete() == self.expected


@pytest.fixture(scope="session")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    for engine, root, staging in session_engine(tmp_path_factory):
        base = root.parent
        config = daemon_config(
            base / "daemon.toml", root=root, engine_url=engine.url, state_dir=base / "state"
        )
        daemon = DaemonProcess(config, env={"VLLM_RELOADER_FAILPOINT_DIR": str(engine.holds)})
        world = World(engine, root, staging, daemon, config)
        try:
            daemon.wait_for("engine.reconciled", version="step-1")
            yield world
        finally:
            assert world.daemon.stop() == 0
            assert not engine.is_paused(), "the daemon must never leave the engine paused"


def _next_step_above_serving(world: World) -> int:
    try:
        manifest = json.loads((world.root / world.serving / "manifest.json").read_text())
        step = int(manifest.get("step") or 1) + next(_steps)
    except FileNotFoundError:  # served from elsewhere (the object store's cache), or deleted
        step = world.highest + next(_steps)
    world.highest = max(world.highest, step)
    return step
