"""Two real CPU vLLM engines on one host, driven by one daemon: a rolling update, canary
engine first, with clients on both; an exploding checkpoint stopped at the first engine; a
killed engine brought back while the other serves. Each engine is bound to its own core."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support import background
from tests.support.checkpoints import write_manifest
from tests.support.engine_fixtures import (
    API_KEY,
    DaemonProcess,
    Engine,
    daemon_config,
    exploding,
    start_engine,
)
from vllm_reloader.tools.demo import stop_process
from vllm_reloader.tools.publish import publish

pytestmark = pytest.mark.engine


class Traffic:
    """Clients spread over the engines, and a sampler of `/is_paused` on each."""

    def __init__(self, engines: list[Engine], every: float = 0.0) -> None:
        """`every`: seconds between a client's requests (0: back to back)."""
        self.engines, self.every = engines, every
        self.stop = threading.Event()
        self.answered = 0
        self.failed: list[str] = []
        self.both_paused = 0
        self.paused: dict[str, int] = {e.url: 0 for e in engines}
        self.threads = [
            threading.Thread(target=self._clients, daemon=True),
            threading.Thread(target=self._sample, daemon=True),
        ]

    def _clients(self) -> None:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            turn = 0
            while not self.stop.wait(self.every):
                engine, turn = self.engines[turn % len(self.engines)], turn + 1
                body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0}
                try:
                    response = http.post(f"{engine.url}/v1/completions", json=body)
                    if response.status_code == 200:
                        self.answered += 1
                    else:
                        self.failed.append(f"{engine.url}: HTTP {response.status_code}")
                except httpx.HTTPError as exc:
                    self.failed.append(f"{engine.url}: {exc!r}")

    def _sample(self) -> None:
        def paused(engine: Engine) -> bool:
            return bool(engine.http.get("/is_paused").json()["is_paused"])

        while not self.stop.wait(0.01):
            first, second = self.engines[0], self.engines[-1]
            a1, b, a2 = paused(first), paused(second), paused(first)  # both: A paused around B's answer
            self.both_paused += a1 and b and a2 and first is not second
            for engine, flag in ((first, a1), (second, b)):
                self.paused[engine.url] += flag

    @contextmanager
    def running(self) -> Iterator[Traffic]:
        with background.running(self.threads, self.stop, join_s=150):
            yield self


def test_e2e_two_engines_roll_canary_first_stop_a_bad_version_and_bring_a_restarted_engine_back(
    tmp_path: Path,
):
    from vllm_reloader.tools.tinymodel import write_checkpoint

    root = tmp_path / "root"
    a, b = write_checkpoint(tmp_path / "a", seed=1), write_checkpoint(tmp_path / "b", seed=2)
    publish(a, root, step=1)
    first = start_engine(root / "step-1", tmp_path / "first.log", env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    second = start_engine(root / "step-1", tmp_path / "second.log", env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    engines = [first, second]
    daemon = None
    try:
        fresh_a = first.complete()
        assert second.complete() == fresh_a
        config = daemon_config(
            tmp_path / "d.toml",
            root=root,
            engine_url=[first.url, second.url],
            state_dir=tmp_path / "state",
            engine_extra="check_interval = 0.5\n",
        )
        with config.open("a") as f:  # the canary alone judges (the probe: tests/e2e/test_e2e_probe.py)
            f.write("[canary]\nprobe = false\n")
        daemon = DaemonProcess(config)
        for engine in engines:
            daemon.wait_for("engine.reconciled", engine=engine.url, version="step-1", timeout=120)

        with Traffic(engines).running() as traffic:
            publish(b, root, step=2)  # the rolling update
            canary_done = daemon.wait_for("reload.succeeded", engine=first.url, version="step-2", timeout=180)
            follower_done = daemon.wait_for(
                "reload.succeeded", engine=second.url, version="step-2", timeout=180
            )
            assert daemon.lines.index(canary_done) < daemon.lines.index(follower_done)

            bad = exploding(b, tmp_path / "staged" / "step-3")
            write_manifest(bad, step=3, overrides={"version": "step-3"})
            bad.rename(root / "step-3")
            rolled = daemon.wait_for("reload.rolled_back", engine=first.url, version="step-3", timeout=180)
            assert rolled["cause"] == "canary" and rolled["to_version"] == "step-2"
            daemon.wait_for("checkpoint.rejected", name="step-3")
            time.sleep(1.0)
        assert traffic.failed == [] and traffic.answered > 0
        # The sampler can miss a pause of a few ms; the daemon's own lines order them for certain.
        assert traffic.both_paused == 0, "the sampler saw both engines paused at once"
        follower_started = daemon.events("reload.started", engine=second.url, version="step-2")[0]
        assert daemon.lines.index(canary_done) < daemon.lines.index(follower_started), "never two"
        assert canary_done["pause_ms"] > 0 and follower_done["pause_ms"] > 0
        assert not daemon.events("reload.started", engine=second.url, version="step-3"), "never reached it"
        outputs_b = first.complete()
        assert outputs_b != fresh_a and second.complete() == outputs_b
        assert first.weight_version() == second.weight_version() == "step-2"

        loads_before = len(daemon.events("reload.succeeded", engine=second.url))
        stop_process(second.process, signal.SIGKILL)  # killed; restarted on its startup model
        second.stop()
        port = int(second.url.rsplit(":", 1)[1])
        # No clients while it starts: vLLM puts the second's engine core on the first's core,
        # where a busy first engine's spinning OpenMP threads starve it for minutes.
        second = start_engine(
            root / "step-1", tmp_path / "second-again.log", port, env={"VLLM_CPU_OMP_THREADS_BIND": "1"}
        )
        engines = [first, second]
        with Traffic([first]).running() as traffic:  # the first keeps serving while it is brought back
            daemon.wait_for("engine.reconciled", engine=second.url, version="step-1", timeout=120)
            deadline = time.monotonic() + 180
            while len(daemon.events("reload.succeeded", engine=second.url)) == loads_before:
                assert time.monotonic() < deadline, "the restarted engine was not brought back"
                time.sleep(0.2)
            back = daemon.events("reload.started", engine=second.url)[-1]
            assert back["version"] == "step-2" and back["from_version"] == "step-1"
        assert traffic.failed == [] and traffic.answered > 0 and traffic.paused[first.url] == 0
        assert second.weight_version() == "step-2" and second.complete() == outputs_b
        assert not first.is_paused() and not second.is_paused()
    finally:
        if daemon is not None:
            assert daemon.stop() == 0
        for engine in engines:
            engine.stop()
