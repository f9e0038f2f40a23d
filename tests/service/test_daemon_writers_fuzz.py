"""Random writers against the reload steps (hypothesis, stateful): checkpoints rewritten in
place, truncated, replaced by rename or deleted — at rest, or while the daemon is held right
after the gate or right after the load. After every step: what the engine was told it serves
is bytes that match that checkpoint's manifest, the engine is not left paused, the loop runs.

The engine's startup model is not changed here: it is what the engine was started with, and
the daemon trusts it as the last way back (docs/operations.md, "Reliability").
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import blake3
import structlog
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.support.checkpoints import write_manifest, write_weights
from tests.support.fake_engine import FakeEngine
from vllm_reloader import config, failpoints
from vllm_reloader.service.daemon import Daemon
from vllm_reloader.tools.publish import publish

CHANGES = ("rewrite in place", "truncate", "replace by rename", "delete the directory")


def change(directory: Path, how: str, seed: int) -> None:
    shard = directory / "model.safetensors"
    if not shard.exists():
        return
    if how == "rewrite in place":
        data = bytearray(shard.read_bytes())
        data[-4:] = (seed % 200 + 1).to_bytes(1, "little") + b"\x00\x80\x3f"  # finite, other bytes
        with shard.open("r+b") as f:
            f.write(data)
    elif how == "truncate":
        os.truncate(shard, max(0, shard.stat().st_size - 8))
    elif how == "replace by rename":
        (directory / ".other").write_bytes(shard.read_bytes())
        os.rename(directory / ".other", shard)
    else:
        shutil.rmtree(directory, ignore_errors=True)


class Writers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.base = Path(tempfile.mkdtemp(prefix="vllm-reloader-writers-"))
        self.root = self.base / "root"
        self.holds = self.base / "failpoints"
        self.holds.mkdir()
        self.step = 1
        self.digests: dict[str, dict[str, str]] = {}
        """version → each shard's blake3, as its manifest lists it."""
        self._publish(seed=1)
        self.saved_hold_dir, failpoints._HOLD_DIR = failpoints._HOLD_DIR, str(self.holds)
        self.capture = structlog.testing.capture_logs()
        self.logs = self.capture.__enter__()
        self.daemon: Daemon | None = None

    @initialize(extension=st.booleans())
    def start(self, extension: bool) -> None:
        self.engine = FakeEngine(startup=str(self.root / "step-1"))
        self.engine.extension, self.engine.read_bytes = extension, True
        (self.base / "state").mkdir(exist_ok=True)  # the daemon never makes it
        cfg = config.Config(
            source=config.SourceConfig(
                path=str(self.root), pending_recheck_interval=0.05, rescan_interval=0.5
            ),
            engine=config.EngineConfig(url="http://engine.test", retry_initial=0.05, retry_max=0.2),
            state=config.StateConfig(dir=self.base / "state"),
        )
        self.daemon = Daemon(cfg, client=self.engine.client(retry_initial=0.05))
        self.thread = threading.Thread(target=self.daemon.run, daemon=True)
        self.thread.start()
        self._settle()

    def _publish(self, seed: int) -> Path:
        name = f"step-{self.step}"
        source = self.base / "trainer" / name
        write_weights(source, seed=seed)
        write_manifest(source)
        published = publish(source, self.root, name=name, step=self.step)
        manifest = json.loads((published / "manifest.json").read_text())
        self.digests[name] = {
            f["path"]: f["blake3"] for f in manifest["files"] if f["path"].endswith(".safetensors")
        }
        self.step += 1
        return published

    def _settle(self, quiet: float = 0.3, limit: float = 15.0) -> None:
        deadline = time.monotonic() + limit
        seen, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            assert self.daemon is not None
            busy = self.daemon.reloader.in_flight is not None or self.engine.paused
            if len(self.logs) != seen or busy:
                seen, since = len(self.logs), time.monotonic()
            elif time.monotonic() - since >= quiet:
                return
            time.sleep(0.02)
        raise AssertionError("the daemon did not settle")

    @rule(seed=st.integers(0, 5))
    def publish_one(self, seed: int) -> None:
        self._publish(seed)
        self._settle()

    @rule(how=st.sampled_from(CHANGES), which=st.integers(0, 50), seed=st.integers(0, 255))
    def change_at_rest(self, how: str, which: int, seed: int) -> None:
        names = sorted(n for n in self.digests if n != "step-1" and (self.root / n).is_dir())
        if names:
            change(self.root / names[which % len(names)], how, seed)
            self._settle()

    @rule(
        point=st.sampled_from(["after_gate", "after_reload"]),
        how=st.sampled_from(CHANGES),
        seed=st.integers(0, 5),
    )
    def change_while_held(self, point: str, how: str, seed: int) -> None:
        hold = self.holds / f"{point}.hold"
        hold.touch()
        try:
            published = self._publish(seed)
            deadline = time.monotonic() + 5
            while not (self.holds / f"{point}.held").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            if (self.holds / f"{point}.held").exists():
                change(published, how, seed)
        finally:
            hold.unlink()
        self._settle()

    @invariant()
    def engine_holds_only_verified_bytes(self) -> None:
        if self.daemon is None:
            return
        assert self.thread.is_alive(), "the loop died"
        assert not [e for e in self.logs if e["event"] in ("daemon.crashed", "daemon.thread_died")]
        assert not self.engine.paused, "the engine was left paused"
        version = self.engine.version
        if version in self.digests and self.engine.held:
            held = {name: blake3.blake3(data).hexdigest() for name, data in self.engine.held.items()}
            assert held == self.digests[version], (
                f"the engine serves {version} with bytes that are not its manifest's"
            )

    def teardown(self) -> None:
        for hold in self.holds.glob("*.hold"):
            hold.unlink()
        if self.daemon is not None:
            self.daemon.request_stop()
            self.thread.join(timeout=20)
            assert not self.thread.is_alive()
        failpoints._HOLD_DIR = self.saved_hold_dir
        self.capture.__exit__(None, None, None)
        shutil.rmtree(self.base, ignore_errors=True)


Writers.TestCase.settings = settings(
    max_examples=8,
    stateful_step_count=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_daemon_engine_holds_only_verified_bytes_whatever_writers_do = Writers.TestCase
