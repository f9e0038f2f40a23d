"""The loop's adapter state, with scripted engines: canary engine first, followers only what
passed there; a failed canary rolls back and is remembered across restarts; never backwards;
adapters canaried again after a base reload; an engine back from a restart is asked again."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from tests.support.adapters import BASE, write_adapter
from tests.support.records import open_records
from vllm_reloader.checkpoint import adapter
from vllm_reloader.checkpoint.layout import Layout
from vllm_reloader.config import parse
from vllm_reloader.errors import EngineCallFailed, EngineUnavailable
from vllm_reloader.service.adapters import Adapters
from vllm_reloader.service.jobs import Ask
from vllm_reloader.service.metrics import Metrics
from vllm_reloader.service.scheduler import Slot, Work
from vllm_reloader.service.status import render
from vllm_reloader.sources.adapters import AdapterGated, AdaptersListed
from vllm_reloader.sources.content import all_of


class ScriptedClient:
    """What the swap calls: loads recorded, canary answers scripted per adapter name."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.broken: set[str] = set()
        """Paths whose adapter answers NaN logprobs."""
        self.slow: set[str] = set()
        """Paths whose adapter's requests time out."""
        self.refuse: str | None = None

    def load_adapter(self, name: str, path: str) -> None:
        self.calls.append(("load", path))
        if self.refuse:
            raise EngineCallFailed(self.refuse, endpoint="/v1/load_lora_adapter", status=500)
        self.loaded[name] = path

    def unload_adapter(self, name: str) -> None:
        self.calls.append(("unload", name))
        self.loaded.pop(name, None)

    def adapters(self) -> dict[str, str]:
        return dict(self.loaded)

    def token_logprobs(
        self, prompt: str, *, max_tokens: int, timeout: float, model: str | None = None
    ) -> Any:
        if model is not None and self.loaded.get(model) in self.slow:
            raise EngineUnavailable(
                "/v1/completions: no whole answer within 30 s", endpoint="/v1/completions"
            )
        bad = model is not None and self.loaded.get(model) in self.broken
        return ([float("nan") if bad else -1.0] * max_tokens, [])


@dataclass
class Served:
    serving: Any = None
    baseline: Layout | None = field(
        default_factory=lambda: Layout({n: ("BF16", s) for n, s in BASE.items()}, {})
    )
    startup: str | None = None
    reconciled: bool = True
    up: bool = True
    lora: Any = None


@dataclass(eq=False)
class ScriptedEngine:
    url: str
    client: ScriptedClient = field(default_factory=ScriptedClient)
    served: Served = field(default_factory=Served)
    log: Any = field(default_factory=structlog.get_logger)
    done: list[Work] = field(default_factory=list)
    """The work its scheduler ran on it, in order."""

    def probes(self, _config: Any) -> bool:
        """No worker extension: adapters are judged by their canary alone."""
        return False

    def run(self, work: Work) -> None:
        """The engine's thread runs the work, and the loop applies its answer."""
        assert isinstance(work.run, Ask)
        self.done.append(work)
        work.then(work.run.call(self.client))  # type: ignore[arg-type]


@dataclass
class Serving:
    fingerprint: str


def config(tmp_path: Path, extra: str = "") -> Any:
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    (tmp_path / "adapters").mkdir(exist_ok=True)
    return parse(
        f'[source]\npath = "{tmp_path}"\n[engine]\nurl = "http://127.0.0.1:1"\n'
        f'[state]\ndir = "{tmp_path / "state"}"\n[adapters]\nroot = "{tmp_path / "adapters"}"\n{extra}'
    )


def version(tmp_path: Path, name: str, step: int, seed: int = 0) -> AdapterGated:
    path = write_adapter(tmp_path / "copies" / name / f"step-{step}@{seed:016x}", seed=seed)
    verdict = adapter.check(path, adapter.Served(BASE, "BF16", 16))
    assert verdict.status == "ready", verdict
    copy = adapter.AdapterVersion(name, f"step-{step}", str(path), f"{seed:016x}", verdict.files)
    return AdapterGated(name, f"step-{step}", (step, 0), verdict, copy)


IN_PLACE = Slot(room=1, drains=False)


def tick(adapters: Adapters, engines: list[ScriptedEngine], rounds: int = 6, slot: Slot = IN_PLACE) -> None:
    """As the engines' schedulers do: each turn, each engine runs the adapter work planned for it."""
    for _ in range(rounds):
        adapters.prepare(engines)  # type: ignore[arg-type]
        for engine in engines:
            if (work := adapters.plan(engine, slot)) is not None:  # type: ignore[arg-type]
                engine.run(work)


def make(tmp_path: Path, extra: str = "") -> Adapters:
    return Adapters(
        config(tmp_path, extra),
        structlog.get_logger(),
        Metrics(),
        post=lambda _: None,
        records=open_records(tmp_path / "state"),
    )


def test_adapters_canary_engine_loads_first_and_followers_only_what_passed_there(tmp_path):
    adapters, first, second = make(tmp_path), ScriptedEngine("a"), ScriptedEngine("b")
    good, bad = version(tmp_path, "support", 1, seed=1), version(tmp_path, "support", 2, seed=2)
    adapters.found(good)
    tick(adapters, [first, second])
    assert first.client.loaded == second.client.loaded == {"support": good.copy.path}
    first.client.broken.add(bad.copy.path)
    with capture_logs() as logs:
        adapters.found(bad)
        tick(adapters, [first, second])
    assert first.client.loaded == {"support": good.copy.path}, "rolled back to the last good copy"
    assert ("load", bad.copy.path) not in second.client.calls, "a follower never loads what failed"
    rolled = next(e for e in logs if e["event"] == "adapter.rolled_back")
    assert rolled["to_version"] == "step-1" and "support" in rolled["reason"]


def test_adapters_a_content_whose_canary_failed_is_not_loaded_after_a_restart(tmp_path):
    adapters, engine = make(tmp_path), ScriptedEngine("a")
    bad = version(tmp_path, "support", 1, seed=1)
    engine.client.broken.add(bad.copy.path)
    adapters.found(bad)
    tick(adapters, [engine])
    assert engine.client.loaded == {}, "no last good version: unloaded"
    restarted, engine_after = make(tmp_path), ScriptedEngine("a")
    with capture_logs() as logs:
        restarted.found(bad)
        tick(restarted, [engine_after])
    assert engine_after.client.calls == []
    said = [e for e in logs if e["event"] == "adapter.rejected"]
    assert [(e["check"], e["log_level"]) for e in said] == [("canary", "info")], "warned once only"
    assert said[0]["reason"].startswith("rejected before: ")


def test_adapters_never_load_an_older_version_by_themselves(tmp_path):
    adapters, engine = make(tmp_path), ScriptedEngine("a")
    newer, older = version(tmp_path, "support", 5, seed=5), version(tmp_path, "support", 3, seed=3)
    adapters.found(newer)
    tick(adapters, [engine])
    adapters.found(older)
    tick(adapters, [engine])
    assert engine.client.loaded == {"support": newer.copy.path}
    assert ("load", older.copy.path) not in engine.client.calls


def test_adapters_are_canaried_again_after_a_base_reload_and_a_failing_one_unloaded(tmp_path):
    adapters, engine = make(tmp_path), ScriptedEngine("a")
    engine.served.serving = Serving("base-1")
    one, two = version(tmp_path, "one", 1, seed=1), version(tmp_path, "two", 1, seed=2)
    adapters.found(one)
    adapters.found(two)
    tick(adapters, [engine])
    assert set(engine.client.loaded) == {"one", "two"}
    engine.client.broken.add(two.copy.path)  # as the new base makes it answer garbage
    engine.served.serving = Serving("base-2")
    with capture_logs() as logs:
        tick(adapters, [engine])
    assert engine.client.loaded == {"one": one.copy.path}
    unloaded = next(e for e in logs if e["event"] == "adapter.unloaded")
    assert unloaded["adapter"] == "two" and unloaded["cause"] == "base_changed"
    assert two.copy.fingerprint not in adapters.rejected, "unfit for base-2, not broken"
    engine.client.broken.clear()
    engine.served.serving = Serving("base-1")  # the base rolled back: the adapter fits again
    tick(adapters, [engine])
    assert engine.client.loaded == {"one": one.copy.path, "two": two.copy.path}


def test_adapters_of_an_engine_back_from_a_restart_are_asked_and_loaded_again(tmp_path):
    adapters, engine = make(tmp_path), ScriptedEngine("a")
    good = version(tmp_path, "support", 1, seed=1)
    adapters.found(good)
    tick(adapters, [engine])
    engine.client.loaded.clear()  # restarted: it holds none
    engine.served.reconciled = False
    tick(adapters, [engine], rounds=1)
    engine.served.reconciled = True
    tick(adapters, [engine])
    assert engine.client.loaded == {"support": good.copy.path}


def test_adapters_unload_a_removed_adapter_only_when_configured(tmp_path):
    for unload, expected in ((False, {"support"}), (True, set())):
        adapters = make(tmp_path / str(unload), f"unload_removed = {str(unload).lower()}\n")
        engine = ScriptedEngine("a")
        adapters.found(version(tmp_path / str(unload), "support", 1, seed=1))
        tick(adapters, [engine])
        adapters.found(AdaptersListed(frozenset()))
        tick(adapters, [engine])
        assert set(engine.client.loaded) == expected


def test_adapters_hold_the_copies_in_use_so_the_collector_keeps_them(tmp_path):
    adapters, engine = make(tmp_path), ScriptedEngine("a")
    first, second, third = (version(tmp_path, "support", n, seed=n) for n in (1, 2, 3))
    for found in (first, second, third):
        adapters.found(found)
        tick(adapters, [engine])
    held = set().union(*adapters.facts.leases().values())
    assert third.copy.path in held, "served and last good"
    assert second.copy.path in held, "the good one before: a recall goes back to it"
    assert first.copy.path not in held, "neither: the collector may remove it"
    status = adapters.snapshot([engine])  # type: ignore[list-item]
    assert status["support"]["engines"] == {"a": "step-3"} and status["support"]["last_good"] == "step-3"
    shown = render({"adapters": status})
    assert "adapter   support  newest step-3, last good step-3" in shown and "serving a: step-3" in shown


def test_adapters_blame_no_version_for_a_timeout_or_a_refusal_and_try_it_again_later(tmp_path, monkeypatch):
    adapters, engine = make(tmp_path), ScriptedEngine("a")
    first = version(tmp_path, "support", 1, seed=1)
    engine.client.slow.add(first.copy.path)
    adapters.found(first)
    with capture_logs() as logs:
        tick(adapters, [engine])
    assert [e["blamed"] for e in logs if e["event"] == "adapter.rolled_back"] == [False]
    assert first.copy.fingerprint not in adapters.rejected and engine.client.loaded == {}
    engine.client.slow.clear()
    engine.client.refuse = "/v1/load_lora_adapter: HTTP 500: busy"
    monkeypatch.setattr("vllm_reloader.retry.time.monotonic", lambda: 10**9)
    with capture_logs() as logs:
        tick(adapters, [engine], rounds=1)
    assert [e["event"] for e in logs if e["event"].startswith("adapter.load")] == [
        "adapter.loading",
        "adapter.load_failed",
    ]
    engine.client.refuse = None
    tick(adapters, [engine])
    assert engine.client.loaded == {}, "waiting out its backoff"
    monkeypatch.setattr("vllm_reloader.retry.time.monotonic", lambda: 10**10)
    tick(adapters, [engine])
    assert engine.client.loaded == {"support": first.copy.path}


def test_adapters_blame_no_version_when_the_engine_fails_without_it_too(tmp_path):
    adapters, engine = make(tmp_path), ScriptedEngine("a")
    other, new = version(tmp_path, "other", 1, seed=1), version(tmp_path, "support", 1, seed=2)
    adapters.found(other)
    tick(adapters, [engine])
    engine.client.broken.add(other.copy.path)  # already broken, whatever loads next
    adapters.found(new)
    with capture_logs() as logs:
        tick(adapters, [engine], rounds=1)
    rolled = next(e for e in logs if e["event"] == "adapter.rolled_back")
    assert rolled["blamed"] is False and "not blamed: without it, other:" in rolled["reason"]
    assert "support" not in engine.client.loaded and new.copy.fingerprint not in adapters.rejected


def test_adapters_a_restarted_daemon_canaries_what_the_canary_engine_holds_before_followers_take_it(tmp_path):
    good = version(tmp_path, "support", 1, seed=1)
    first, second = ScriptedEngine("a"), ScriptedEngine("b")
    first.client.loaded = {"support": good.copy.path}  # loaded by the daemon before its restart
    adapters = make(tmp_path)
    adapters.found(good)
    with capture_logs() as logs:
        tick(adapters, [first, second])
    assert second.client.loaded == {"support": good.copy.path}
    assert ("load", good.copy.path) not in first.client.calls, "canaried where it is, not loaded again"
    assert not [e for e in logs if e["event"] == "adapter.rolled_back"]


def test_adapters_a_restarted_daemon_unloads_an_uncanaried_broken_version_the_canary_engine_holds(tmp_path):
    bad = version(tmp_path, "support", 1, seed=1)
    first, second = ScriptedEngine("a"), ScriptedEngine("b")
    first.client.loaded = {"support": bad.copy.path}  # its canary never finished before the restart
    first.client.broken.add(bad.copy.path)
    adapters = make(tmp_path)
    adapters.found(bad)
    tick(adapters, [first, second])
    assert first.client.loaded == {} and second.client.loaded == {}


def test_adapters_swap_drained_where_readiness_drains_and_only_while_the_budget_has_room(tmp_path):
    adapters, engine = make(tmp_path), ScriptedEngine("a")
    adapters.found(version(tmp_path, "support", 1, seed=1))
    tick(adapters, [engine], rounds=1)  # what it holds: nothing
    adapters.prepare([engine])  # type: ignore[list-item]
    assert adapters.plan(engine, Slot(room=0, drains=True)) is None, "as a reload: it waits for room"  # type: ignore[arg-type]
    work = adapters.plan(engine, Slot(room=1, drains=True))  # type: ignore[arg-type]
    assert work is not None and work.kind == "adapter swap" and work.drains and not work.pauses
    in_place = adapters.plan(engine, Slot(room=0, drains=False))  # type: ignore[arg-type]
    assert in_place is not None and not in_place.drains, "no balancer to drain for: in place, no budget"


def test_adapters_are_judged_at_the_engines_max_rank_and_lora_dtype_unless_configured_lower():
    from vllm_reloader.engine.serverinfo import UNSAID, Lora
    from vllm_reloader.service.adapter_records import GateView

    baseline = Layout({n: ("F32", v) for n, v in BASE.items()}, {})
    view = GateView()
    said = view.of(baseline, "m", None, Lora(8, "F16"))
    assert said is not None and (said.max_rank, said.dtype) == (8, "F16")
    assert view.of(baseline, "m", None, Lora(8, "F16")) is said, "the same view: nothing judged again"
    lower = view.of(baseline, "m", 4, Lora(8, None))
    assert lower is not None and (lower.max_rank, lower.dtype) == (4, "F32")
    unsaid = view.of(baseline, "m", None, UNSAID)
    assert unsaid is not None and unsaid.max_rank == 16, "vLLM's default"
    assert view.of(None, "m", None, UNSAID) is None


def test_adapters_canaried_again_without_an_answer_are_asked_again_only_after_a_backoff(tmp_path):
    adapters, engine = make(tmp_path), ScriptedEngine("a")
    engine.served.serving = Serving("base-1")
    one = version(tmp_path, "one", 1, seed=1)
    adapters.found(one)
    tick(adapters, [engine])
    engine.client.slow.add(one.copy.path)  # the engine no longer answers in time
    engine.served.serving = Serving("base-2")
    with capture_logs() as logs:
        tick(adapters, [engine], rounds=10)
    failed = [e for e in logs if e["event"] == "adapter.recheck_failed"]
    assert len(failed) == 1 and failed[0]["retry_in_s"] == pytest.approx(5.0, rel=0.11), (
        "not a canary in a tight loop"
    )
    assert engine.client.loaded == {"one": one.copy.path}, "kept: nothing judged it"


def test_adapters_forget_an_engine_a_sighup_let_go_so_copies_are_collected_again(tmp_path):
    adapters, kept, dropped = make(tmp_path), ScriptedEngine("a"), ScriptedEngine("b")
    adapters.found(version(tmp_path, "support", 1, seed=1))
    tick(adapters, [kept])
    adapters.prepare([kept, dropped])  # type: ignore[list-item]
    adapters.facts.held["b"] = None  # b's holdings not asked yet
    assert all_of("adapter") in adapters.facts.leases()["engine:b:adapters"], "b's unknown: no copy may go"
    tick(adapters, [kept])  # b dropped from [engine] urls
    assert "b" not in adapters.facts.held
    assert all(all_of("adapter") not in held for held in adapters.facts.leases().values())


def test_adapters_a_source_replaced_by_a_sighup_lets_go_of_its_copies(tmp_path):
    adapters = make(tmp_path)
    before = adapters.source
    assert before is not None
    before.content.hold(before.holder, [str(tmp_path / "copies" / "support" / "step-1@1")])
    (tmp_path / "other").mkdir()
    changed = adapters.config.model_copy(
        update={"adapters": adapters.config.adapters.model_copy(update={"root": str(tmp_path / "other")})}
    )
    adapters.reconfigure(changed)
    assert adapters.source is not before
    assert not [h for held in adapters.records.leases().values() for h in held if h == before.holder]
    adapters.close()
