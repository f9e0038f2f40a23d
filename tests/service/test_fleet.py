"""A fleet on one object-store prefix (moto's S3 on loopback): canary-host daemons in this
process, each against its own scripted engine, and a follower — a follower daemon, or its
object-store source polled by hand. What a follower loads, or goes back from, rests on the
records the canary hosts write; these tests read the outcome, never the key layout."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog
from safetensors.numpy import save_file

from tests.support.checkpoints import TENSORS, MakeCheckpoint, write_manifest
from tests.support.daemon_fixtures import events_in, wait_for_event
from tests.support.fake_engine import BadSteps, FakeEngine
from tests.support.records import source_records
from tests.support.store_fixtures import WRITABLE, Bucket
from vllm_reloader import config
from vllm_reloader.checkpoint import order
from vllm_reloader.service.daemon import Daemon
from vllm_reloader.sources.remote import Downloaded, Rejected, RemoteSource

pytestmark = pytest.mark.stores(*WRITABLE)


@dataclasses.dataclass
class Host:
    daemon: Daemon
    engine: FakeEngine
    url: str
    thread: threading.Thread


class Follower:
    """A follower's object-store source, polled by hand."""

    def __init__(self, source: RemoteSource, posted: list[Downloaded | Rejected | Any]) -> None:
        self.source, self.posted = source, posted

    def poll(self) -> None:
        self.source.poll()

    def fetched(self) -> list[str]:
        return [order.base_name(m.name) for m in self.posted if isinstance(m, Downloaded)]

    def rejected(self) -> list[Rejected]:
        return [m for m in self.posted if isinstance(m, Rejected)]

    def poll_until(self, done: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.05)


class Fleet:
    def __init__(self, tmp_path: Path, bucket: Bucket, make: MakeCheckpoint, logs: list[dict]) -> None:
        self.tmp_path, self.bucket, self.make, self.logs = tmp_path, bucket, make, logs
        self.startup = make("startup", root=tmp_path / "models")
        self.hosts: list[Host] = []
        self.seeds = iter(range(100, 10_000))

    def config(self, label: str, rollout: config.RolloutConfig, canary: bool = True) -> config.Config:
        return config.Config(
            source=config.SourceConfig(
                path=self.bucket.url, poll_interval=0.1, pending_recheck_interval=0.05
            ),
            engine=config.EngineConfig(url=f"http://{label}.test", retry_initial=0.05, retry_max=0.2),
            state=config.StateConfig(dir=self.tmp_path / label, min_free_bytes=0),
            canary=config.CanaryConfig(enabled=canary),
            rollout=rollout,
        )

    def daemon(
        self,
        label: str,
        *,
        role: str = "canary",
        host: str | None = None,
        canary: bool = True,
        bad_steps: set[int] | frozenset[int] = frozenset(),
    ) -> Host:
        """A daemon in this process; its engine at http://<label>.test (events name it)."""
        rollout = config.RolloutConfig(role=role, host=host or label)  # type: ignore[arg-type]
        cfg = self.config(label, rollout, canary)
        cfg.state.dir.mkdir(exist_ok=True)  # the daemon never makes it
        engine = FakeEngine(startup=str(self.startup))
        engine.garbage = BadSteps(set(bad_steps))
        url = cfg.engine.url
        daemon = Daemon(cfg, clients={url: engine.client(url, retry_initial=0.05)})
        thread = threading.Thread(target=daemon.run, daemon=True)
        thread.start()
        found = Host(daemon, engine, url, thread)
        self.hosts.append(found)
        self.wait_for("engine.reconciled", engine=url)
        return found

    def follower(self, label: str = "follower", min_canaries: int = 1) -> Follower:
        rollout = config.RolloutConfig(role="follow", host=label, min_canaries=min_canaries)
        posted: list[Any] = []
        source = RemoteSource(
            self.config(label, rollout),
            serving=lambda: order.NOTHING,
            rejected=dict,
            post=posted.append,
            **source_records(self.config(label, rollout).state.dir),
        )
        return Follower(source, posted)

    def publish(self, name: str, step: int, *, fault: str | None = None) -> Path:
        """A checkpoint under `name` (its manifest's version), uploaded manifest last; `fault`:
        "nan" (weights the gate rejects), "digest" (a shard that fails its manifest's digest)."""
        directory = self.make(name, step=step, root=self.tmp_path / f"src-{next(self.seeds)}", seed=step)
        if fault == "nan":  # a diverged run: the served layout, one tensor all NaN
            tensors = {n: np.zeros(shape, np.float32) for n, shape in TENSORS.items()}
            tensors["model.embed_tokens.weight"][:] = np.nan
            save_file(tensors, str(directory / "model.safetensors"))
            write_manifest(directory, step=step)
        if fault == "digest":
            manifest = json.loads((directory / "manifest.json").read_text())
            manifest["files"][0]["blake3"] = "0" * 64
            (directory / "manifest.json").write_text(json.dumps(manifest))
        self.bucket.upload_dir(directory, name, skip=("manifest.json",))
        self.bucket.put(f"{name}/manifest.json", (directory / "manifest.json").read_bytes())
        return directory

    def events(self, event: str, /, **fields: object) -> list[dict]:
        return events_in(self.logs, event, **fields)

    def wait_for(self, event: str, /, timeout: float = 15.0, **fields: object) -> dict:
        return wait_for_event(self.logs, event, timeout, **fields)

    def records(self, name: str) -> list[dict[str, Any]]:
        """Every object under a `_verdicts/` of `name` (or of a directory named after it), as JSON,
        wherever it sits there."""
        found = []
        for key in self.bucket.listed():
            top, _, rest = key.partition("/")
            if order.base_name(top) == name and rest.startswith("_verdicts/"):
                found.append(json.loads(self.bucket.read(key)))
        return found


@pytest.fixture
def fleet(tmp_path: Path, bucket: Bucket, make_checkpoint: MakeCheckpoint) -> Iterator[Fleet]:
    with structlog.testing.capture_logs() as logs:
        found = Fleet(tmp_path, bucket, make_checkpoint, logs)
        yield found
        for host in found.hosts:
            host.daemon.request_stop()
        for host in found.hosts:
            host.thread.join(timeout=15)
            assert not host.thread.is_alive()
            assert not host.engine.paused, "no engine is ever left paused"


def verdict_written(fleet: Fleet, host: str, timeout: float = 15.0) -> None:
    """The canary host's object-store thread has handled a verdict (written it, or not)."""
    deadline = time.monotonic() + timeout
    events = ("verdict.recorded", "verdict.exists", "verdict.not_recorded", "verdict.host_conflict")
    while time.monotonic() < deadline:
        if any(fleet.events(e, host=host) for e in events):
            return
        time.sleep(0.02)
    raise AssertionError(f"canary host {host} handled no verdict: {[e['event'] for e in fleet.logs]}")


# -- case 2: a verdict is bound to the content it judged ------------------------------------


def test_follower_never_counts_a_pass_of_another_content_under_the_same_name(fleet: Fleet):
    canary = fleet.daemon("canary-1", bad_steps={2})
    fleet.publish("latest", step=1)
    fleet.wait_for("verdict.recorded", host="canary-1", verdict="passed")
    fleet.publish("latest", step=2)  # the same name rewritten with other content, which fails
    fleet.wait_for("reload.rolled_back", engine=canary.url, cause="canary")
    time.sleep(0.5)  # the object-store thread's next round: its failure written, or dropped
    follower = fleet.follower()
    follower.poll()
    assert follower.fetched() == [], "a pass of the first content never clears the second"
    (rejected,) = follower.rejected()
    assert rejected.name == "latest" and rejected.check == "canary"
    assert "canary host canary-1 failed it" in rejected.reason


# -- case 3: a canary host whose canary is off passes nothing ---------------------------------


def test_canary_host_with_its_canary_off_records_no_pass(fleet: Fleet):
    fleet.daemon("canary-1", canary=False)
    fleet.publish("step-1", step=1)
    fleet.wait_for("reload.succeeded", version="step-1")
    verdict_written(fleet, "canary-1")
    assert not [r for r in fleet.records("step-1") if r.get("verdict") == "passed"]
    follower = fleet.follower()
    follower.poll()
    assert follower.fetched() == []
    assert follower.source.pending == {"step-1": "waiting for canary hosts: 0 of 1 passed"}


# -- case 4: what a canary host's gate rejects is failed for the fleet ------------------------


@pytest.mark.parametrize(
    "fault, canary",
    [("nan", True), ("digest", True), ("nan", False)],
    ids=["local-gate", "download-digests", "local-gate-canary-off"],
)
def test_canary_host_gate_rejection_fails_the_version_for_followers(fleet: Fleet, fault: str, canary: bool):
    """A failure needs no canary: the gate's judgement stands on its own, canary on or off."""
    fleet.daemon("canary-1", canary=canary)
    fleet.publish("step-1", step=1, fault=fault)
    rejected_here = fleet.wait_for("checkpoint.rejected", version="step-1")
    assert rejected_here["check"] == ("finite" if fault == "nan" else "digests")
    follower = fleet.follower()
    follower.poll_until(lambda: bool(follower.rejected()))
    (rejected,) = follower.rejected()
    assert rejected.check == "canary" and "canary host canary-1 failed it" in rejected.reason
    assert follower.fetched() == [] and "step-1" not in follower.source.pending


# -- case 5: an odd key elsewhere in the checkpoint hides no record ---------------------------


def test_follower_reads_the_records_of_a_checkpoint_holding_a_key_that_cannot_be_listed(fleet: Fleet):
    fleet.bucket.put("step-5//stray", b"x")  # obstore cannot list it: the checkpoint is read by HEAD
    fleet.daemon("canary-1")
    fleet.publish("step-5", step=5)
    fleet.wait_for("verdict.recorded", host="canary-1", verdict="passed")
    follower = fleet.follower()
    follower.poll()
    assert follower.fetched() == ["step-5"], follower.source.pending


# -- records of the previous release ----------------------------------------------------------


def test_follower_counts_no_record_in_the_previous_releases_layout(fleet: Fleet):
    fleet.publish("step-1", step=1)
    old = {"verdict": "passed", "host": "canary-1", "version": "step-1", "at": 0, "daemon_version": "0.1"}
    fleet.bucket.put("step-1/_verdicts/canary-1.json", json.dumps(old).encode())
    follower = fleet.follower()
    follower.poll()
    assert follower.fetched() == []
    assert follower.source.pending == {"step-1": "waiting for canary hosts: 0 of 1 passed"}


# -- a version failed after followers loaded it -----------------------------------------------


def test_follower_rolls_back_a_version_a_canary_host_failed_after_it_loaded_it(fleet: Fleet):
    fleet.daemon("canary-1")
    follower = fleet.daemon("follower-1", role="follow")
    fleet.publish("step-1", step=1)
    fleet.wait_for("reload.succeeded", engine=follower.url, version="step-1")
    fleet.publish("step-2", step=2)
    fleet.wait_for("reload.succeeded", engine=follower.url, version="step-2")
    fleet.daemon("canary-2", bad_steps={2})  # a second canary host, whose canary fails step-2
    rolled = fleet.wait_for("reload.rolled_back", engine=follower.url, timeout=20)
    assert (rolled["cause"], rolled["version"], rolled["to_version"]) == ("fleet", "step-2", "step-1")
    assert "canary host canary-2 failed it" in rolled["reason"]
    assert follower.engine.version == "step-1" and not follower.engine.paused
    time.sleep(0.5)  # several more polls: step-2 stays rejected, step-1 serves
    loads = [c for c in follower.engine.calls if c.startswith("reload:") and "step-2" in c]
    assert len(loads) == 1, "never loaded again"
    assert follower.engine.version == "step-1"
    rejected = fleet.events("checkpoint.rejected", version="step-2")
    assert rejected and all(r["check"] == "canary" for r in rejected)


# -- one host name, two canary hosts ----------------------------------------------------------


def test_two_canary_hosts_with_one_name_are_told_apart_and_lose_no_failure(fleet: Fleet):
    fleet.daemon("a", host="canary-1")
    fleet.publish("step-1", step=1)
    fleet.wait_for("verdict.recorded", host="canary-1", verdict="passed")
    fleet.daemon("b", host="canary-1", bad_steps={1})  # configured with the first one's name
    conflict = fleet.wait_for("verdict.host_conflict", host="canary-1")
    assert "[rollout] host" in conflict["fix"]
    follower = fleet.follower()
    follower.poll()
    assert follower.fetched() == [], "the second host's failure is not lost behind the first's pass"
    (rejected,) = follower.rejected()
    assert rejected.check == "canary" and "canary host canary-1 failed it" in rejected.reason
