"""Several engines on one host, against scripted engines (faults on demand); the real
engines' rolling update is in tests/e2e/test_e2e_engines.py."""

from __future__ import annotations

import hashlib
import signal
import time

import pytest

from tests.support.checkpoints import TENSORS
from tests.support.daemon_fixtures import ENGINE_URL, follower_url
from tests.support.engine_fixtures import DaemonProcess, daemon_config
from tests.support.fake_engine import REFUSED, FakeEngine, FakeEngineServer, error
from vllm_reloader.service import control, status


def two_engines(root, make_checkpoint) -> tuple[FakeEngine, FakeEngine]:  # type: ignore[no-untyped-def]
    make_checkpoint("step-1", step=1, root=root)
    first, second = FakeEngine(startup=str(root / "step-1")), FakeEngine(startup=str(root / "step-1"))
    return first, second


def never_both_paused(first: FakeEngine, second: FakeEngine) -> list[bool]:
    """Record, during every load on either engine, whether the other one was paused too."""
    both: list[bool] = []
    first.during_load = lambda _path: both.append(second.paused)
    second.during_load = lambda _path: both.append(first.paused)
    return both


def test_engines_roll_a_checkpoint_through_canary_engine_first_one_at_a_time(start, root, make_checkpoint):
    first, second = two_engines(root, make_checkpoint)
    both = never_both_paused(first, second)
    running = start(first, followers=[second])
    running.wait_for("engine.reconciled", engine=follower_url(0))
    make_checkpoint("step-2", step=2, root=root, seed=2)
    canary_done = running.wait_for("reload.succeeded", version="step-2", engine=ENGINE_URL)
    follower_done = running.wait_for("reload.succeeded", version="step-2", engine=follower_url(0))
    assert running.logs.index(canary_done) < running.logs.index(follower_done)
    assert len(running.events("checkpoint.ready", name="step-2")) == 1, "one gate for both engines"
    assert first.version == second.version == "step-2"
    assert both == [False, False], "never both paused"
    answer = status.answer(running.daemon.snapshot())
    assert [(v["url"], v["version"], v["state"]) for v in answer["engines"]] == [
        (ENGINE_URL, "step-2", "serving"),
        (follower_url(0), "step-2", "serving"),
    ]
    shown = status.render(answer)
    content = hashlib.sha256((root / "step-2" / "manifest.json").read_bytes()).hexdigest()
    assert [v["fingerprint"] for v in answer["engines"]] == [content, content], "which content each holds"
    assert f"  {ENGINE_URL}  step-2 ({content[:16]})  serving" in shown
    assert f"  {follower_url(0)}  step-2 ({content[:16]})  serving" in shown


def test_engines_with_max_unavailable_two_reload_followers_together(start, root, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    engines = [FakeEngine(startup=str(root / "step-1")) for _ in range(3)]
    paused_at_once: list[int] = []
    for engine in engines:
        engine.during_load = lambda _path: (
            paused_at_once.append(sum(e.paused for e in engines)),
            time.sleep(0.2),
        )
    running = start(engines[0], followers=engines[1:], max_unavailable=2)
    running.wait_for("engine.reconciled", engine=follower_url(1))
    make_checkpoint("step-2", step=2, root=root, seed=2)
    for url in (follower_url(0), follower_url(1)):
        running.wait_for("reload.succeeded", version="step-2", engine=url)
    assert max(paused_at_once) == 2 and paused_at_once[0] == 1, "canary engine alone, then two followers"


def test_engines_canary_failure_rolls_back_the_first_and_never_reaches_the_others(
    start, root, make_checkpoint
):
    first, second = two_engines(root, make_checkpoint)
    first.garbage.add(str(root / "step-2"))
    second.garbage.add(str(root / "step-2"))
    running = start(first, followers=[second])
    running.wait_for("engine.reconciled", engine=follower_url(0))
    make_checkpoint("step-2", step=2, root=root, seed=2)
    running.wait_for("reload.rolled_back", version="step-2", engine=ENGINE_URL)
    running.wait_for("checkpoint.rejected", name="step-2")
    make_checkpoint("step-3", step=3, root=root, seed=3)
    running.wait_for("reload.succeeded", version="step-3", engine=follower_url(0))
    assert f"reload:{root / 'step-2'}" not in second.calls
    assert first.version == second.version == "step-3"


def test_engines_bring_a_restarted_follower_back_without_pausing_the_canary_engine(
    start, root, make_checkpoint
):
    first, second = two_engines(root, make_checkpoint)
    running = start(first, followers=[second], engine_check_interval=0.1)
    make_checkpoint("step-2", step=2, root=root, seed=2)
    running.wait_for("reload.succeeded", version="step-2", engine=follower_url(0))
    first_calls = len(first.calls)
    second.version, second.loaded = "default", second.startup  # restarted on its startup model
    running.wait_for("engine.changed", engine=follower_url(0))
    running.wait_for("engine.behind", engine=follower_url(0), version="step-2")
    back = running.wait_for("reload.started", engine=follower_url(0), from_version="step-1")
    assert back["version"] == "step-2"
    deadline = time.monotonic() + 10
    while len(running.events("reload.succeeded", engine=follower_url(0))) < 2:
        assert time.monotonic() < deadline, "the follower was not brought back"
        time.sleep(0.02)
    assert second.version == "step-2"
    assert "/pause" not in first.calls[first_calls:], "the canary engine kept serving"


def test_engines_retry_a_failed_follower_reload_with_backoff_and_blame_no_checkpoint(
    start, root, make_checkpoint
):
    first, second = two_engines(root, make_checkpoint)
    second.fail[f"reload:{root / 'step-2'}"] = error(500, "out of memory")
    running = start(first, followers=[second])
    running.wait_for("engine.reconciled", engine=follower_url(0))
    make_checkpoint("step-2", step=2, root=root, seed=2)
    retry = running.wait_for("engine.retry", engine=follower_url(0))
    assert "out of memory" in retry["reason"] and retry["retry_in_s"] > 0
    answer = status.answer(running.daemon.snapshot())
    view = answer["engines"][1]
    assert view["state"] == "behind" and "out of memory" in view["last_error"]
    assert "FAILED: " in status.render(answer)
    assert not running.events("checkpoint.rejected"), "it passed on the canary engine"
    del second.fail[f"reload:{root / 'step-2'}"]
    running.wait_for("reload.succeeded", version="step-2", engine=follower_url(0), timeout=15)
    assert second.version == "step-2"
    assert status.answer(running.daemon.snapshot())["engines"][1]["last_error"] is None


def test_engines_of_different_layouts_are_refused_at_start(start, root, make_checkpoint, tmp_path):
    make_checkpoint("step-1", step=1, root=root)
    other = make_checkpoint("other", root=tmp_path / "models", shapes={**TENSORS, "lm_head.weight": (17, 8)})
    first, second = FakeEngine(startup=str(root / "step-1")), FakeEngine(startup=str(other))
    running = start(first, followers=[second])
    failed = running.wait_for("daemon.not_runnable")
    assert follower_url(0) in failed["reason"] and "layout differs" in failed["reason"]
    assert running.daemon.exit_code == 2


@pytest.mark.parametrize("down", [0, 1])
def test_engines_one_unreachable_engine_does_not_stop_the_other(start, root, make_checkpoint, down):
    first, second = two_engines(root, make_checkpoint)
    engines = (first, second)
    running = start(first, followers=[second])
    running.wait_for("engine.reconciled", engine=follower_url(0))
    engines[down].fail["/weight_info"] = error(503, "down")
    engines[down].fail["/server_info"] = error(503, "down")
    running.daemon.reloader.check_now()
    running.wait_for("engine.error", engine=(ENGINE_URL, follower_url(0))[down])
    line = status.line(running.daemon.snapshot())
    assert "1/2 engines serving" in line


def test_engines_sighup_adds_and_drops_engines_as_urls_says(tmp_path, root, make_checkpoint):
    """A real daemon subprocess and two scripted engines behind real sockets."""
    first, second = two_engines(root, make_checkpoint)
    servers = [FakeEngineServer(first), FakeEngineServer(second)]
    config = daemon_config(
        tmp_path / "d.toml", root=root, engine_url=[servers[0].url], state_dir=tmp_path / "s"
    )
    daemon = DaemonProcess(config)
    try:
        daemon.wait_for("engine.reconciled", engine=servers[0].url)
        make_checkpoint("step-2", step=2, root=root, seed=2)
        daemon.wait_for("reload.succeeded", engine=servers[0].url, version="step-2")
        assert second.version == "default", "not one of its engines yet"

        daemon_config(config, root=root, engine_url=[s.url for s in servers], state_dir=tmp_path / "s")
        daemon.process.send_signal(signal.SIGHUP)
        daemon.wait_for("reload.succeeded", engine=servers[1].url, version="step-2")
        assert second.version == "step-2"

        daemon_config(config, root=root, engine_url=[servers[1].url], state_dir=tmp_path / "s")
        daemon.process.send_signal(signal.SIGHUP)
        daemon.wait_for("engine.dropped", engine=servers[0].url)
        make_checkpoint("step-3", step=3, root=root, seed=3)
        daemon.wait_for("reload.succeeded", engine=servers[1].url, version="step-3")
        assert first.version == "step-2" and second.version == "step-3"
        assert daemon.stop() == 0
    finally:
        daemon.stop()
        for server in servers:
            server.close()


def test_follower_restarted_on_another_content_of_the_version_is_brought_to_the_canarys(
    start, root, tmp_path, make_checkpoint
):
    """The daemon stopped mid-rollout of a rewrite: both engines report `latest`, the canary
    engine holds B (its own record, the state file), the follower still A. A version that names
    two contents says nothing of which one a follower holds: it is brought to B."""
    from tests.support.checkpoints import write_manifest
    from vllm_reloader.checkpoint import gate
    from vllm_reloader.service import state

    contents = []
    for fp, seed in (("a" * 16, 1), ("b" * 16, 2)):
        staged = make_checkpoint(f"latest@{fp}", step=5, root=tmp_path / "w", seed=seed)
        write_manifest(staged, step=5, overrides={"version": "latest"})
        contents.append(staged.rename(root / staged.name))
    a, b = contents
    verdict = gate.check(b, serving=None)
    served = state.Loaded(
        name=b.name, version="latest", path=str(b), since=1.0, step=5,
        files=dict(verdict.files), fingerprint=verdict.fingerprint,
    )  # fmt: skip
    state.save(tmp_path / "state", state.State(serving=served, good=(served,)))
    canary, follower = FakeEngine(startup=str(a)), FakeEngine(startup=str(a))
    canary.version, canary.loaded = "latest", str(b)
    follower.version, follower.loaded = "latest", str(a)
    running = start(canary, followers=[follower])
    running.wait_for("reload.succeeded", engine=follower_url(0))
    assert follower.loaded == str(b) and canary.loaded == str(b)
    assert not [c for c in canary.calls if c.startswith("reload:")], "the canary engine's record holds"


@pytest.mark.parametrize("check", ["canary", "probe"])
def test_follower_whose_canary_fails_rejects_the_version_for_the_host_and_every_engine_leaves_it(
    start, root, make_checkpoint, check: str
):
    """step-2 passes on the canary engine but answers NaN on the follower (or its forward pass
    there, in the pause): loading it there again would fail again, so the host rejects it (no
    retry loop), and the canary engine goes back from it too (before: reloaded on the follower
    every retry, served on the canary)."""
    first, second = two_engines(root, make_checkpoint)
    second.extension = check == "probe"
    running = start(first, followers=[second])
    running.wait_for("engine.reconciled", engine=follower_url(0))
    (second.garbage if check == "canary" else second.probe_broken).add(str(root / "step-2"))
    make_checkpoint("step-2", step=2, root=root, seed=2)
    running.wait_for("reload.rolled_back", version="step-2", engine=follower_url(0), cause=check)
    rejected = running.wait_for("checkpoint.rejected", name="step-2")
    assert rejected["check"] == check
    back = running.wait_for("reload.rolled_back", version="step-2", engine=ENGINE_URL)
    assert back["cause"] == check and back["to_version"] == "step-1"
    time.sleep(1.0)  # retries would come within retry_max (0.2 s)
    assert first.version == second.version == "step-1"
    loads = [c for c in second.calls if c == f"reload:{root / 'step-2'}"]
    assert len(loads) == 1, "never loaded again on the follower"


def test_version_rejected_after_a_follower_canary_failure_is_left_after_a_restart(
    start, root, tmp_path, make_checkpoint
):
    """The daemon restarted while engines still served a version the host had rejected (its
    rollback under way): what the state file says was rejected is recalled again."""
    from vllm_reloader.checkpoint import gate
    from vllm_reloader.service import state

    first, second = two_engines(root, make_checkpoint)
    bad = make_checkpoint("step-2", step=2, root=root, seed=2)
    verdict = gate.check(bad, serving=None)
    served = state.Loaded(
        name="step-2", version="step-2", path=str(bad), since=1.0, step=2,
        files=dict(verdict.files), fingerprint=verdict.fingerprint,
    )  # fmt: skip
    good = state.Loaded(name="step-1", version="step-1", path=str(root / "step-1"), since=0.5, step=1)
    rejection = state.Rejection(
        version="step-2", reason="canary: NaN", fingerprint=verdict.fingerprint, at=1.0
    )
    state.save(tmp_path / "state", state.State(serving=served, good=(good,), rejected={"step-2": rejection}))
    for engine in (first, second):
        engine.version, engine.loaded = "step-2", str(bad)
    running = start(first, followers=[second])
    for url in (ENGINE_URL, follower_url(0)):
        back = running.wait_for("reload.rolled_back", engine=url)
        assert back["cause"] == "rejected" and back["to_version"] == "step-1"
    assert first.version == second.version == "step-1"


def test_engines_a_follower_trickling_its_answers_holds_neither_the_canary_engine_nor_status(
    start, root, make_checkpoint, tmp_path
):
    """Measured before: a follower trickling `/weight_info` for 8 s (timeout 1 s) held `status`
    and the canary engine's next reload for 7.8 s. Its calls now run on its own thread, within a
    deadline: the loop goes on while the follower is still mid-answer."""
    first, second = two_engines(root, make_checkpoint)
    follower = FakeEngineServer(second)
    try:
        running = start(first, followers=[follower.url], timeout=1.0, engine_check_interval=0.2)
        running.wait_for("engine.reconciled", engine=follower.url)
        follower.slow["/weight_info"] = 0.3  # its ~29-byte answer lasts ~9 s
        assert follower.trickling.wait(5), "the follower's health check is under way"
        make_checkpoint("step-2", step=2, root=root, seed=2)
        running.wait_for("reload.succeeded", version="step-2", engine=ENGINE_URL)
        answer = control.call(running.daemon.config.control_socket, "status")
        assert answer["ok"] and [e["url"] for e in answer["engines"]] == [ENGINE_URL, follower.url]
        assert not follower.trickled.is_set(), "all of this while the follower was still answering"
        down = running.wait_for("engine.unreachable", engine=follower.url)
        assert "/weight_info: no whole answer within 1 s" in str(down["reason"])
    finally:
        follower.close()


def test_engines_retry_a_load_refused_for_memory_on_the_canary_engine_and_blame_no_checkpoint(
    start, root, make_checkpoint
):
    first, second = two_engines(root, make_checkpoint)
    first.fail[f"reload:{root / 'step-2'}"] = error(500, REFUSED)
    running = start(first, followers=[second])
    running.wait_for("engine.reconciled", engine=follower_url(0))
    make_checkpoint("step-2", step=2, root=root, seed=2)
    refused = running.wait_for("engine.reload_refused", engine=ENGINE_URL, version="step-2")
    assert "free device memory" in refused["reason"] and "gpu_memory_utilization" in refused["fix"]
    assert refused["retry_in_s"] > 0 and refused["to_version"] == "step-1"
    for other in ("reload.failed", "reload.rolled_back", "engine.retry"):  # one refusal, one line
        assert not running.events(other, engine=ENGINE_URL), other
    assert first.version == "step-1", "the last good weights loaded back"
    assert "reload:" + str(root / "step-2") not in second.calls, "the follower waits for the canary engine"
    assert not running.events("checkpoint.rejected"), "the engine's memory is no fault of the checkpoint"
    del first.fail[f"reload:{root / 'step-2'}"]
    running.wait_for("reload.succeeded", version="step-2", engine=ENGINE_URL, timeout=15)
    running.wait_for("reload.succeeded", version="step-2", engine=follower_url(0), timeout=15)
    assert first.version == second.version == "step-2"
    assert status.answer(running.daemon.snapshot())["engines"][0]["last_error"] is None
