"""The fleet rules for adapters on the loop, with scripted engines: a canary host tells the
fleet its canary engine's verdicts; a follower recalled from a content goes back from it on
every engine (to the version good before it, or unloads the adapter)."""

from __future__ import annotations

from pathlib import Path

import structlog
from structlog.testing import capture_logs

from tests.support.records import open_records
from vllm_reloader.config import parse
from vllm_reloader.service.adapters import Adapters
from vllm_reloader.service.jobs import Ask
from vllm_reloader.service.metrics import Metrics
from vllm_reloader.service.scheduler import RELOAD_KINDS, Slot
from vllm_reloader.sources.adapter_fleet import AdapterRecalled
from vllm_reloader.sources.verdicts import Verdict

from .test_adapters import ScriptedEngine, tick, version

SLOT = Slot(room=1, drains=False)


def on_store(tmp_path: Path, role: str) -> Adapters:
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    config = parse(
        f'[source]\npath = "s3://bucket/runs"\n[engine]\nurl = "http://127.0.0.1:1"\n'
        f'[state]\ndir = "{tmp_path / "state"}"\n[adapters]\nroot = "s3://bucket/adapters"\n'
        f'[rollout]\nrole = "{role}"\nhost = "host-a"\n'
    )
    return Adapters(
        config,
        structlog.get_logger(),
        Metrics(),
        post=lambda _: None,
        records=open_records(tmp_path / "state"),
    )


def told(adapters: Adapters) -> list[Verdict]:
    assert adapters.source is not None and adapters.source.fleet is not None
    return adapters.source.fleet.records.pending()


def test_a_canary_host_tells_the_fleet_its_canary_engines_pass_and_blamed_failure_only(tmp_path, s3_env):
    adapters, canary, follower = on_store(tmp_path, "canary"), ScriptedEngine("a"), ScriptedEngine("b")
    good, bad = version(tmp_path, "support", 1, seed=1), version(tmp_path, "support", 2, seed=2)
    adapters.found(good)
    tick(adapters, [canary, follower])
    canary.client.broken.add(bad.copy.path)
    adapters.found(bad)
    tick(adapters, [canary, follower])
    assert [(v.version, v.fingerprint, v.passed) for v in told(adapters)] == [
        ("step-1", good.copy.fingerprint, True),
        ("step-2", bad.copy.fingerprint, False),
    ], "one verdict per content, from the canary engine only"
    assert "its canary failed" in (told(adapters)[1].reason or "")
    kept = open_records(tmp_path / "state").outbox("adapters")
    assert [found["version"] for _, found in kept] == ["step-1", "step-2"], (
        "kept across a restart until written"
    )


def test_a_follower_tells_the_fleet_no_pass_and_goes_back_from_a_recalled_content(tmp_path, s3_env):
    adapters, first, second = on_store(tmp_path, "follow"), ScriptedEngine("a"), ScriptedEngine("b")
    one, two = version(tmp_path, "support", 1, seed=1), version(tmp_path, "support", 2, seed=2)
    for found in (one, two):
        adapters.found(found)
        tick(adapters, [first, second])
    assert first.client.loaded == second.client.loaded == {"support": two.copy.path}
    assert told(adapters) == [], "a follower's pass counts for nothing"
    adapters.prepare([first, second])  # type: ignore[list-item]
    assert adapters.holds == {("support", two.copy.fingerprint)}, "what the source checks for recalls"
    with capture_logs() as logs:
        adapters.found(AdapterRecalled("support", "step-2", two.copy.fingerprint, "canary host c failed it"))
        tick(adapters, [first, second])
    assert first.client.loaded == second.client.loaded == {"support": one.copy.path}, "the good one before"
    assert [e["reason"] for e in logs if e["event"] == "adapter.recalled"] == ["canary host c failed it"]
    assert two.copy.fingerprint in adapters.rejected, "kept: a restart does not load it again"
    with capture_logs() as logs:
        adapters.found(AdapterRecalled("support", "step-1", one.copy.fingerprint, "canary host c failed it"))
        tick(adapters, [first, second])
    assert first.client.loaded == second.client.loaded == {}, "nothing good to go back to: unloaded"
    assert [e["cause"] for e in logs if e["event"] == "adapter.unloaded"] == ["rejected", "rejected"]


def test_a_sighup_that_moves_the_state_dir_hands_the_unwritten_verdicts_over(tmp_path, s3_env):
    adapters, canary = on_store(tmp_path, "canary"), ScriptedEngine("a")
    adapters.found(version(tmp_path, "support", 1, seed=1))
    tick(adapters, [canary])
    [verdict] = told(adapters)
    old = adapters.source
    adapters.rejected.remember("ab" * 16, "its canary failed: NaN")
    (tmp_path / "state2").mkdir()
    adapters.records.move_to(tmp_path / "state2")  # the daemon moves the store, then reconfigures
    adapters.reconfigure(
        adapters.config.model_copy(
            update={"state": adapters.config.state.model_copy(update={"dir": tmp_path / "state2"})}
        )
    )
    assert adapters.source is not old and told(adapters) == [verdict]
    moved = open_records(tmp_path / "state2")
    assert [found["version"] for _, found in moved.outbox("adapters")] == ["step-1"]
    assert "ab" * 16 in moved.all("adapter_rejected"), "a restart forgets no rejection"
    adapters.close()


def test_the_version_good_before_is_gone_back_to_on_a_recall_only(tmp_path):
    from vllm_reloader.service.adapter_records import Adapter

    one, two = (version(tmp_path, "support", n, seed=n).copy for n in (1, 2))
    assert one is not None and two is not None
    state = Adapter()
    state.passed(one)
    state.passed(two)
    assert state.want(True, {two.fingerprint}) is None, "unfit on a new base: not the older one"
    state.good = None  # its copy proved changed: judged again
    assert state.want(True, set()) is None, "nor while the newer one is judged again"
    state.good = two
    state.recalled(two.fingerprint)
    assert state.want(False, {two.fingerprint}) == one, "a canary host failed it: the one before"
    state.recalled(one.fingerprint)
    assert state.want(False, {one.fingerprint, two.fingerprint}) is None


def test_an_adapter_swap_is_work_a_stop_waits_for(tmp_path, s3_env):
    adapters, engine = on_store(tmp_path, "canary"), ScriptedEngine("a")
    adapters.found(version(tmp_path, "support", 1, seed=1))
    tick(adapters, [engine], rounds=2)  # what it holds; nothing to canary again
    engine.client.loaded.clear()
    adapters.facts.held["a"] = {}
    adapters.prepare([engine])  # type: ignore[list-item]
    work = adapters.plan(engine, SLOT)  # type: ignore[arg-type]
    assert work is not None and work.kind == "adapter swap" and work.kind in RELOAD_KINDS


def test_a_pass_whose_answer_was_lost_is_the_last_good_once_its_canary_passes_again(tmp_path, s3_env):
    adapters, canary, follower = on_store(tmp_path, "canary"), ScriptedEngine("a"), ScriptedEngine("b")
    one, two = version(tmp_path, "support", 1, seed=1), version(tmp_path, "support", 2, seed=2)
    adapters.found(one)
    tick(adapters, [canary, follower])
    adapters.found(two)
    adapters.prepare([canary, follower])  # type: ignore[list-item]
    work = adapters.plan(canary, SLOT)  # type: ignore[arg-type]
    assert work is not None and isinstance(work.run, Ask)
    work.run.call(canary.client)  # type: ignore[arg-type]  # loaded and canaried, its answer lost
    adapters.facts.held[canary.url] = None  # as after a regroup: asked again
    tick(adapters, [canary, follower])
    assert follower.client.loaded == {"support": two.copy.path}, "the followers follow it"
    assert [v.version for v in told(adapters) if v.passed] == ["step-1", "step-2"], "and the fleet hears"


def test_a_pass_that_lands_after_its_recall_does_not_bring_it_back(tmp_path, s3_env):
    adapters, canary, follower = on_store(tmp_path, "follow"), ScriptedEngine("a"), ScriptedEngine("b")
    one, two = version(tmp_path, "support", 1, seed=1), version(tmp_path, "support", 2, seed=2)
    adapters.found(one)
    tick(adapters, [canary, follower])
    adapters.found(two)
    adapters.prepare([canary, follower])  # type: ignore[list-item]
    swap = adapters.plan(canary, SLOT)  # type: ignore[arg-type]
    assert swap is not None and swap.kind == "adapter swap", "step-2's swap under way"
    adapters.found(AdapterRecalled("support", "step-2", two.copy.fingerprint, "canary host c failed it"))
    canary.run(swap)  # its pass lands after the recall
    tick(adapters, [canary, follower])
    assert canary.client.loaded == follower.client.loaded == {"support": one.copy.path}
