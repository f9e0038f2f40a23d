"""Where features meet, each fact has one owner: one scheduler per engine takes it out of
rotation and counts every kind of work against `max_unavailable`; whether it is in rotation is
worked out from what it holds and what is remembered, so a daemon or an engine restarting
changes nothing of it; a copy in use is never deleted under a swap. Scripted engines, the
daemon in this process, the real adapter source and collector."""

from __future__ import annotations

import importlib.util
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.service.test_readiness import readiness_config, ready
from tests.support.adapters import write_adapter
from tests.support.daemon_fixtures import ENGINE_URL, Running, follower_url
from tests.support.fake_engine import FakeEngine, error
from vllm_reloader import config


def lora_engines(root: Path, n: int) -> list[FakeEngine]:
    engines = [FakeEngine(startup=str(root / "step-1")) for _ in range(n)]
    for engine in engines:
        engine.requests_running = engine.requests_waiting = 0  # a drain empties at once
        engine.lora_config = {"max_lora_rank": 16}
    return engines


def adapters_config(tmp_path: Path) -> config.AdaptersConfig:
    (tmp_path / "adapters").mkdir(exist_ok=True)
    (tmp_path / "copies").mkdir(exist_ok=True)
    return config.AdaptersConfig(root=str(tmp_path / "adapters"), copies=tmp_path / "copies", interval=0.1)


def until(predicate: Callable[[], object], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.02)


def holding(engine: FakeEngine, version: str) -> bool:
    return Path(engine.loras.get("support", "")).name.startswith(f"{version}@")


class Unavailable:
    """Samples, every few ms, how many engines are out of rotation for work of ours (drained)
    or paused: the most at once is what `max_unavailable` bounds."""

    def __init__(self, running: Running, engines: list[FakeEngine]) -> None:
        self.running, self.engines, self.most = running, engines, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        rotation = self.running.daemon.reloader.engines.rotation
        urls = [ENGINE_URL, *(follower_url(i) for i in range(len(self.engines) - 1))]
        while not self.done.wait(0.003):
            out = sum(
                "drain" in (rotation.why_out(url) or "") or engine.paused
                for url, engine in zip(urls, self.engines, strict=True)
            )
            self.most = max(self.most, out)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.most


def test_a_base_reload_waits_while_a_drained_adapter_swap_holds_another_engine_out(
    start, root, tmp_path, make_checkpoint
):
    """Before: the reloader counted only its own reloads, so a canary engine's reload drained
    it while a follower was drained for an adapter swap: two of three out, max_unavailable 1."""
    make_checkpoint("step-1", step=1, root=root)
    engines = lora_engines(root, 3)
    write_adapter(tmp_path / "adapters" / "support" / "step-1", seed=1)
    running = start(
        engines[0], followers=engines[1:], max_unavailable=1,
        readiness=readiness_config(drain=True, grace=0.0), adapters=adapters_config(tmp_path),
    )  # fmt: skip
    until(lambda: all(holding(e, "step-1") for e in engines), what="step-1 on every engine")
    swapping = threading.Event()

    def slow_swap(path: str) -> None:
        if "step-2" in path:
            swapping.set()
            time.sleep(1.5)

    for follower in engines[1:]:
        follower.during_lora = slow_swap
    sampled = Unavailable(running, engines)
    write_adapter(tmp_path / "adapters" / "support" / "step-2", seed=2)
    assert swapping.wait(20), "a follower's drained adapter swap under way"
    make_checkpoint("step-2", step=2, root=root, seed=2)  # the canary engine's reload wants to start
    for url in (ENGINE_URL, follower_url(0), follower_url(1)):
        running.wait_for("reload.succeeded", version="step-2", engine=url, timeout=30)
    until(lambda: all(holding(e, "step-2") for e in engines), what="step-2 on every engine")
    assert sampled.stop() == 1, "never more engines out than max_unavailable, whatever the work"


def test_an_engine_whose_drained_adapter_swap_could_not_go_back_stays_out_while_it_holds_the_failure(
    start, root, tmp_path, make_checkpoint
):
    """Before: the drained swap put its engine back in rotation whatever happened, with the
    adapter that failed its canary still loaded."""
    make_checkpoint("step-1", step=1, root=root)
    engine, follower = lora_engines(root, 2)
    write_adapter(tmp_path / "adapters" / "support" / "step-1", seed=1)
    running = start(
        engine, followers=[follower], readiness=readiness_config(drain=True, grace=0.0),
        adapters=adapters_config(tmp_path),
    )  # fmt: skip
    until(lambda: holding(engine, "step-1") and holding(follower, "step-1"))
    good = engine.loras["support"]

    def broken_with_no_way_back(path: str) -> None:
        if "step-2" in path:
            engine.garbage.add(path)  # its answers are NaN
            engine.lora_refused.add(good)  # and loading step-1 back is refused

    engine.during_lora = broken_with_no_way_back
    rotation, seen_in = running.daemon.reloader.engines.rotation, []
    done = threading.Event()

    def sample() -> None:  # its readiness first, then what it holds: holding it then, it held it before
        while not done.wait(0.002):
            why = rotation.why_out(ENGINE_URL)
            if why is None and holding(engine, "step-2"):
                seen_in.append(engine.loras["support"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    write_adapter(tmp_path / "adapters" / "support" / "step-2", seed=2)
    rolled = running.wait_for("adapter.rolled_back", engine=ENGINE_URL, timeout=20)
    assert rolled["error"] and rolled["error"].startswith("going back"), rolled
    engine.lora_refused.clear()  # the engine takes step-1 back from now on
    until(lambda: holding(engine, "step-1") and ready(running, 0)[0] == 200, what="step-1 back, in rotation")
    done.set()
    sampler.join()
    assert seen_in == [], "never in rotation while it held the adapter that failed its canary"
    assert ready(running, 1) == (200, "ready") and holding(follower, "step-1"), "the follower never took it"


def test_an_engine_on_weights_whose_canary_failed_stays_out_after_a_daemon_restart_and_is_back_after_its_own(
    start, root, tmp_path, make_checkpoint
):
    """Before: why an engine was out lived in memory: a restarted daemon read it 200, and an
    engine restarted on good weights stayed 503 for ever."""
    make_checkpoint("step-1", step=1, root=root)
    engine, follower = FakeEngine(str(root / "step-1")), FakeEngine(str(root / "step-1"))
    engine.requests_running = engine.requests_waiting = 0
    engine.garbage.add(str(root / "step-2"))
    listen = readiness_config(drain=True, grace=0.0)
    baseline = make_checkpoint("base", root=tmp_path / "models")  # the model's layout, wherever step-1 is
    both = {"followers": [follower], "readiness": listen, "engine_check_interval": 0.2, "baseline": baseline}
    running = start(engine, **both)
    running.wait_for("engine.reconciled", engine=ENGINE_URL)
    running.wait_for("engine.reconciled", engine=follower_url(0))
    (root / "step-1").rename(root / ".gone-step-1")  # nothing intact to go back to
    make_checkpoint("step-2", step=2, root=root, seed=1)
    running.wait_for("reload.canary_failed_no_fallback", timeout=20)
    assert ready(running, 0)[0] == 503
    running.stop()
    restarted = start(engine, **both)
    until(lambda: len(restarted.events("engine.reconciled", engine=ENGINE_URL)) >= 2, what="reconciled again")
    status, why = ready(restarted, 0)
    assert status == 503 and "did not end on verified weights" in why, why
    (root / ".gone-step-1").rename(root / "step-1")
    engine.version, engine.loaded = "default", engine.startup  # the engine restarted, on step-1
    until(lambda: ready(restarted, 0) == (200, "ready"), what="back in rotation on its startup weights")
    assert engine.version == "step-1" and ready(restarted, 1) == (200, "ready")


def test_an_adapter_copy_a_swap_loads_is_kept_when_a_newer_version_arrives_meanwhile(
    start, root, tmp_path, make_checkpoint, monkeypatch
):
    """Before: the source thread pruned from a snapshot of what was in use, and the copy a swap
    was loading went when a newer version came (its folder rotated away): that newer one
    failing then unloaded the adapter instead of going back to it."""
    if importlib.util.find_spec("vllm_reloader.service.leases") is not None:
        monkeypatch.setattr("vllm_reloader.service.leases.INTERVAL", 0.05)  # the collector each turn
    make_checkpoint("step-1", step=1, root=root)
    [engine] = lora_engines(root, 1)
    write_adapter(tmp_path / "adapters" / "support" / "step-1", seed=1)
    running = start(engine, adapters=adapters_config(tmp_path))
    until(lambda: holding(engine, "step-1"))

    def meanwhile(path: str) -> None:
        if "step-2" in path and not (tmp_path / "adapters" / "support" / "step-3").exists():
            # a newer version arrives (the trainer rotates step-2 away), is judged
            write_adapter(tmp_path / "adapters" / "support" / "step-3", seed=3)
            shutil.rmtree(tmp_path / "adapters" / "support" / "step-2")
            running.wait_for("adapter.verified", version="step-3")
            time.sleep(0.5)
        if "step-3" in path:
            engine.garbage.add(path)  # and it fails its canary

    engine.during_lora = meanwhile
    write_adapter(tmp_path / "adapters" / "support" / "step-2", seed=2)
    rolled = running.wait_for("adapter.rolled_back", version="step-3", timeout=30)
    assert rolled["to_version"] == "step-2", rolled
    assert holding(engine, "step-2") and Path(engine.loras["support"]).is_dir(), "gone back to its copy"


@pytest.mark.parametrize("kind", ["download", "adapter"])
def test_the_collector_deletes_no_copy_a_setting_pointed_at_the_other_stores_directory(tmp_path, kind):
    """Before: `[adapters] copies` set to the download cache was accepted, and the adapter prune
    deleted downloaded checkpoints, the served one included (anything shaped `*/*@*`). Now
    such a config is refused (`paths.apart`), and the collector only ever deletes a copy it
    made and registered."""
    import structlog

    from tests.support.records import open_records
    from vllm_reloader.sources.content import ContentStore

    served = tmp_path / "cache" / "checkpoints" / "step-1@0123456789abcdef"
    served.mkdir(parents=True)
    content = ContentStore(open_records(tmp_path / "state"), structlog.get_logger())
    content.declare({})
    assert content.collect() == [] and served.is_dir(), f"not a {kind} it made: never deleted"


def test_three_engines_under_load_never_have_more_out_than_allowed_nor_serve_what_failed(
    start, root, tmp_path, make_checkpoint
):
    """Drained base reloads and adapter swaps interleaved, some failing their canary, while
    requests come and go on every engine: never more than `max_unavailable` out for work, and
    never an engine in rotation holding weights or an adapter that failed its canary."""
    make_checkpoint("step-1", step=1, root=root)
    engines = lora_engines(root, 3)
    urls = [ENGINE_URL, follower_url(0), follower_url(1)]
    write_adapter(tmp_path / "adapters" / "support" / "step-1", seed=1)
    running = start(
        engines[0], followers=engines[1:], max_unavailable=1,
        readiness=readiness_config(drain=True, grace=0.0), adapters=adapters_config(tmp_path),
    )  # fmt: skip
    until(lambda: all(holding(e, "step-1") for e in engines), what="step-1 on every engine")
    broken = str(root / "step-3")

    def failing_adapter(engine: FakeEngine) -> Callable[[str], None]:
        def load(path: str) -> None:
            time.sleep(0.4)  # swaps and reloads take a while: they overlap
            if "step-3@" in path:
                engine.garbage.add(path)

        return load

    for engine in engines:
        engine.garbage.add(broken)
        engine.during_lora = failing_adapter(engine)
        engine.during_load = lambda _path: time.sleep(0.2)
    rotation, done, seen_serving_failed = running.daemon.reloader.engines.rotation, threading.Event(), []

    def load_and_watch() -> None:  # requests come and go; readiness read first, then what it holds
        n = 0
        while not done.wait(0.004):
            n += 1
            for engine, url in zip(engines, urls, strict=True):
                engine.requests_running = int((n // 25) % 3 == 0)  # a request in flight a third of the time
                if rotation.why_out(url) is None and (
                    engine.loaded in engine.garbage or any(p in engine.garbage for p in engine.loras.values())
                ):
                    seen_serving_failed.append((url, engine.loaded, dict(engine.loras)))

    watcher = threading.Thread(target=load_and_watch, daemon=True)
    watcher.start()
    sampled = Unavailable(running, engines)
    for step in (2, 3, 4):  # adapter and base versions interleaved; step-3 of each fails its canary
        write_adapter(tmp_path / "adapters" / "support" / f"step-{step}", seed=step)
        time.sleep(0.6)  # the followers' swaps under way
        make_checkpoint(f"step-{step}", step=step, root=root, seed=step)
        if step == 3:  # each tried (on the canary engine) before a newer one passes it by
            running.wait_for("reload.rolled_back", version="step-3", timeout=60)
            running.wait_for("adapter.rolled_back", version="step-3", timeout=60)
        time.sleep(0.3)
    until(
        lambda: all(e.version == "step-4" and holding(e, "step-4") for e in engines),
        timeout=90, what="step-4 weights and adapter on every engine",
    )  # fmt: skip
    done.set()
    watcher.join()
    assert sampled.stop() == 1, "never more engines out than max_unavailable"
    assert seen_serving_failed == [], "never in rotation with what failed its canary"
    started = running.events("reload.started", version="step-3") + running.events(
        "adapter.loading", version="step-3"
    )
    assert {e["engine"] for e in started} == {ENGINE_URL}, (
        "what failed on the canary engine went nowhere else"
    )


def test_an_engine_whose_adapter_broke_on_its_new_base_is_out_until_canaried_and_while_it_will_not_unload(
    start, root, tmp_path, make_checkpoint
):
    """After a drained base reload, what the engine holds is canaried again before it takes
    traffic; one adapter broken on the new base whose unload fails keeps it out (before: back
    in rotation between the reload and the canary, and for good once the unload failed)."""
    make_checkpoint("step-1", step=1, root=root)
    engine, follower = lora_engines(root, 2)
    write_adapter(tmp_path / "adapters" / "support" / "step-1", seed=1)
    running = start(
        engine, followers=[follower], readiness=readiness_config(drain=True, grace=0.0),
        adapters=adapters_config(tmp_path),
    )  # fmt: skip
    until(lambda: holding(engine, "step-1") and ready(running, 0)[0] == 200, what="loaded, in rotation")
    adapter = engine.loras["support"]

    def on_base(path: str) -> None:
        if "step-2" in path:  # the new base breaks the adapter trained on step-1
            engine.garbage.add(adapter)
            engine.fail["/v1/unload_lora_adapter"] = error(500, "unload refused")

    engine.during_load = on_base
    rotation, seen_in, done = running.daemon.reloader.engines.rotation, [], threading.Event()

    def sample() -> None:  # readiness first, then what it holds
        while not done.wait(0.002):
            if rotation.why_out(ENGINE_URL) is None and engine.loras.get("support") == adapter:  # noqa: SIM102
                if adapter in engine.garbage:
                    seen_in.append(time.monotonic())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    make_checkpoint("step-2", step=2, root=root, seed=2)
    running.wait_for("reload.succeeded", version="step-2", engine=ENGINE_URL, timeout=30)
    running.wait_for("adapter.recheck_failed", engine=ENGINE_URL, timeout=30)
    time.sleep(0.5)
    status, why = ready(running, 0)
    done.set()
    sampler.join()
    assert seen_in == [], "never in rotation holding an adapter broken on its base weights"
    assert status == 503 and "adapters" in why, why


def test_an_engine_dropped_and_added_back_while_its_reload_runs_keeps_one_thread(
    start, root, make_checkpoint, monkeypatch
):
    """Before: the engine added back got a second scheduler beside the one still loading."""
    import signal

    from vllm_reloader.service import reconfigure
    from vllm_reloader.service.messages import SignalReceived

    make_checkpoint("step-1", step=1, root=root)
    canary, follower = FakeEngine(str(root / "step-1")), FakeEngine(str(root / "step-1"))
    running = start(canary, followers=[follower])
    running.wait_for("engine.reconciled", engine=follower_url(0))
    loading, most = [0], [0]

    def slow(_path: str) -> None:
        loading[0] += 1
        most[0] = max(most[0], loading[0])
        time.sleep(1.5)
        loading[0] -= 1

    follower.during_load = slow
    both = running.daemon.config
    one = both.model_copy(update={"engine": both.engine.model_copy(update={"urls": (ENGINE_URL,)})})
    configs = iter([one, both])
    monkeypatch.setattr(
        reconfigure, "prepare", lambda *_a, **_k: reconfigure.Rebuilt(next(configs), sources=False)
    )
    make_checkpoint("step-2", step=2, root=root, seed=2)
    running.wait_for("reload.started", version="step-2", engine=follower_url(0), timeout=20)
    running.daemon.inbox.put(SignalReceived(signal.SIGHUP))  # drops the follower mid-load
    running.wait_for("engine.dropped", timeout=5)
    running.daemon.inbox.put(SignalReceived(signal.SIGHUP))  # and adds it back
    until(lambda: follower.version == "step-2" and not loading[0], what="the follower on step-2")
    time.sleep(0.5)
    assert most[0] == 1, "one load at a time on one engine"
    assert (
        len(running.daemon.reloader.engines.schedulers) == 2 and not running.daemon.reloader.engines.retired
    )


def test_an_engine_waiting_for_its_resume_counts_against_max_unavailable(start, root, make_checkpoint):
    """Before: an engine left paused by a failed resume counted nowhere, and a follower's
    reload paused it too: two of two paused, max_unavailable 1."""
    import httpx

    make_checkpoint("step-1", step=1, root=root)
    canary, follower = FakeEngine(str(root / "step-1")), FakeEngine(str(root / "step-1"))
    running = start(canary, followers=[follower], max_unavailable=1)
    running.wait_for("engine.reconciled", engine=follower_url(0))
    refuse_until = [0.0]

    def resume() -> httpx.Response:
        if time.monotonic() < refuse_until[0]:
            return httpx.Response(500, json={"error": {"message": "resume failed"}})
        canary.paused = False
        return httpx.Response(200, json={"status": "resumed"})

    def on_load(path: str) -> None:
        if "step-2" in path and not refuse_until[0]:
            refuse_until[0] = time.monotonic() + 2.0
            canary.fail["/resume"] = resume

    canary.during_load = on_load
    most, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.003):
            most[0] = max(most[0], canary.paused + follower.paused)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    make_checkpoint("step-2", step=2, root=root, seed=2)
    running.wait_for("reload.succeeded", version="step-2", engine=follower_url(0), timeout=30)
    done.set()
    sampler.join()
    assert most[0] == 1, "never both paused"


def test_an_odd_answer_to_a_warm_up_does_not_stop_the_daemon(start, root, make_checkpoint):
    """Before: a logprob the parser could not take (a 400-digit number) killed the engine's
    thread at its warm-up, the daemon exited 1, and after a restart the same again."""
    import httpx

    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(str(root / "step-1"))
    huge = b'{"choices":[{"logprobs":{"token_logprobs":[-1' + b"0" * 400 + b"]}}]}"
    engine.fail["/v1/completions"] = lambda: httpx.Response(200, content=huge)
    running = start(engine)
    warmed = running.wait_for("engine.warmed", timeout=20)
    assert warmed["problem"] and "token_logprobs" in warmed["problem"], warmed
    time.sleep(0.5)
    assert not running.events("daemon.thread_died") and running.thread.is_alive()
