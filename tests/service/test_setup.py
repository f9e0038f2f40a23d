"""The daemon against engines not set up for it: one line and exit 2, not retries forever."""

from __future__ import annotations

import pytest

from tests.support.checkpoints import write_manifest, write_weights
from tests.support.fake_engine import FakeEngine
from tests.support.hub_cache import cache_model
from vllm_reloader.engine.capabilities import REQUIRED_ROUTES
from vllm_reloader.tools.publish import publish

BIGGER = {
    "model.embed_tokens.weight": (16, 8),
    "model.layers.0.mlp.up_proj.weight": (64, 8),
    "lm_head.weight": (16, 8),
}


def stopped_with(running, code: int) -> dict:
    found = running.wait_for("daemon.stopped")
    assert found["exit_code"] == code and running.daemon.exit_code == code
    return found


def test_daemon_exits_2_naming_the_variable_when_dev_mode_is_off(start, root, make_checkpoint):
    engine = FakeEngine(startup=str(make_checkpoint("step-1", step=1, root=root)))
    engine.dev_mode = False
    running = start(engine)
    stopped_with(running, 2)
    [line] = running.events("daemon.not_runnable")
    assert "VLLM_SERVER_DEV_MODE=1" in line["reason"]
    assert not running.events("engine.unreachable") and not running.events("engine.error"), "no retries"


def test_daemon_exits_2_before_any_reload_of_an_engine_over_several_nodes_it_does_not_lead(
    start, root, make_checkpoint
):
    """Each rank reads the path on its own node: a single-node daemon cannot vouch for them."""
    engine = FakeEngine(startup=str(make_checkpoint("step-1", step=1, root=root)))
    engine.nnodes, engine.extension = 2, True
    running = start(engine)
    make_checkpoint("step-2", step=2, root=root)
    stopped_with(running, 2)
    [line] = running.events("daemon.not_runnable")
    assert "runs on 2 nodes" in line["reason"] and 'role = "lead"' in line["reason"]
    assert not [c for c in engine.calls if c.startswith("reload:")] and "/pause" not in engine.calls


def test_daemon_exits_2_when_the_engine_lacks_a_route_it_drives(start, root, make_checkpoint):
    engine = FakeEngine(startup=str(make_checkpoint("step-1", step=1, root=root)))
    engine.release, engine.routes = "0.26.0", set(REQUIRED_ROUTES) - {"/collective_rpc"}
    running = start(engine)
    stopped_with(running, 2)
    assert "/collective_rpc" in running.events("daemon.not_runnable")[0]["reason"]


def test_daemon_logs_the_engines_release_and_routes_when_reconciled(start, root, make_checkpoint):
    engine = FakeEngine(startup=str(make_checkpoint("step-1", step=1, root=root)))
    engine.release, engine.routes = "0.32.0", {*REQUIRED_ROUTES, "/v1/completions"}
    running = start(engine)
    reconciled = running.wait_for("engine.reconciled")
    assert reconciled["vllm_version"] == "0.32.0" and reconciled["routes"] == sorted(REQUIRED_ROUTES)
    assert not running.events("engine.untested")


def test_daemon_warns_on_a_newer_release_and_drives_it(start, root, tmp_path, make_checkpoint):
    engine = FakeEngine(startup=str(make_checkpoint("step-1", step=1, root=root)))
    engine.release, engine.routes = "0.40.0", set(REQUIRED_ROUTES)
    running = start(engine)
    running.wait_for("engine.untested", vllm_version="0.40.0")
    publish(make_checkpoint("src", root=tmp_path / "staging", seed=2), root, step=2)
    running.wait_for("reload.succeeded", version="step-2")


def test_daemon_uses_the_hub_snapshot_of_a_model_id_as_baseline(
    start, root, tmp_path, make_checkpoint, monkeypatch
):
    cache = tmp_path / "hf" / "hub"
    cache_model(cache, "org/tiny", write_weights(tmp_path / "base")[0].parent)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    engine = FakeEngine(startup="org/tiny")
    running = start(engine)
    reconciled = running.wait_for("engine.reconciled")
    assert reconciled["path"].startswith(str(cache / "models--org--tiny" / "snapshots"))
    make_checkpoint("wrong", step=2, root=root, shapes=BIGGER)
    running.wait_for("checkpoint.rejected", name="wrong", check="layout")
    make_checkpoint("step-3", step=3, root=root, seed=3)
    running.wait_for("reload.succeeded", version="step-3")


def test_daemon_says_another_models_layout_and_a_broken_config_json_need_different_fixes(
    start, root, make_checkpoint
):
    make_checkpoint("step-1", step=1, root=root)
    running = start(FakeEngine(startup=str(root / "step-1")))
    running.wait_for("engine.reconciled", version="step-1")
    make_checkpoint("wrong", step=2, root=root, shapes=BIGGER)
    other = running.wait_for("checkpoint.rejected", name="wrong", check="layout")
    assert other["fix"].startswith("it is not the model the engine serves"), other
    broken = root.parent / "broken"
    write_weights(broken, seed=3)
    (broken / "config.json").write_text("{not json")
    write_manifest(broken, step=3)
    broken.rename(root / "broken")
    unreadable = running.wait_for("checkpoint.rejected", name="broken", check="layout")
    assert "config.json" in unreadable["reason"] and unreadable["fix"].startswith("fix it and publish")


def test_daemon_exits_2_saying_what_to_set_when_a_hub_model_is_not_cached(
    start, root, tmp_path, make_checkpoint, monkeypatch
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    running = start(FakeEngine(startup="org/tiny"))
    make_checkpoint("step-2", step=2, root=root)
    stopped_with(running, 2)
    [line] = running.events("daemon.not_runnable")
    for named in ("org/tiny", "HF_HUB_CACHE", "[engine] baseline"):
        assert named in line["reason"]
    assert not running.events("reload.started"), "nothing is loaded without a baseline"


def test_configured_baseline_overrides_the_startup_model(start, root, tmp_path, make_checkpoint, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    write_weights(tmp_path / "baseline")
    running = start(FakeEngine(startup="org/tiny"), baseline=tmp_path / "baseline")
    make_checkpoint("step-2", step=2, root=root)
    running.wait_for("reload.succeeded", version="step-2")


def test_unreadable_configured_baseline_is_an_error_naming_it(start, root, tmp_path, make_checkpoint):
    engine = FakeEngine(startup=str(make_checkpoint("step-1", step=1, root=root)))
    running = start(engine, baseline=tmp_path / "nowhere")
    stopped_with(running, 2)
    reason = running.events("daemon.not_runnable")[0]["reason"]
    assert reason.startswith(f"[engine] baseline = {tmp_path / 'nowhere'}: no readable")


def test_after_an_engine_restart_onto_unreadable_files_the_old_baseline_holds(
    start, root, tmp_path, make_checkpoint
):
    engine = FakeEngine(startup=str(make_checkpoint("step-1", step=1, root=root)))
    running = start(engine, engine_check_interval=0.05)
    running.wait_for("engine.warmed")  # named step-1 first: a naming after the restart would hide it
    engine.startup, engine.version = str(tmp_path / "gone"), "default"  # restarted on files we cannot read
    running.wait_for("gate.no_baseline")
    make_checkpoint("wrong", step=2, root=root, shapes=BIGGER)
    running.wait_for("checkpoint.rejected", name="wrong", check="layout")
    assert not running.events("daemon.stopped"), "the daemon goes on with the baseline it had"


@pytest.fixture(autouse=True)
def _no_ambient_hub_cache(monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HOME", raising=False)


@pytest.mark.parametrize(
    ("release", "pause_mode", "drained", "reload_mode", "said"),
    [
        ("0.33.0", "wait", False, None, ["engine.pause_rejects"]),
        ("0.34.0", "abort", False, "direct", ["engine.pause_rejects", "engine.reload_mode_direct"]),
        ("0.34.0", "wait", True, None, []),  # drained: out of rotation before its pause
        ("0.34.0", "keep", False, "layerwise", []),
        ("0.32.0", "wait", False, None, []),
        ("0.32.0", "keep", False, "direct", ["engine.reload_mode_direct"]),
    ],
)
def test_setup_says_what_a_release_does_that_an_operator_would_not_expect(
    release: str, pause_mode: str, drained: bool, reload_mode: str | None, said: list[str]
):
    import structlog

    from vllm_reloader.config import EngineConfig
    from vllm_reloader.engine.capabilities import Capabilities
    from vllm_reloader.engine.serverinfo import ServerConfig
    from vllm_reloader.service import setup

    engine = EngineConfig(url="http://127.0.0.1:8000", pause_mode=pause_mode)  # type: ignore[arg-type]
    server = ServerConfig("/models/a", sleep_mode=False, extension=True, reload_mode=reload_mode)
    with structlog.testing.capture_logs() as logs:
        setup.per_release(engine, drained, Capabilities(release, None, True), server, structlog.get_logger())
    assert [line["event"] for line in logs] == said
    assert all(line["log_level"] == "warning" and "fix" in line for line in logs)


ALL_ROUTES = frozenset({*REQUIRED_ROUTES, "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


@pytest.mark.parametrize(
    ("adapters", "routes", "lora_on", "said"),
    [
        (True, frozenset(REQUIRED_ROUTES), True, ["adapter.not_runnable"]),
        (True, ALL_ROUTES, False, ["adapter.not_runnable"]),  # the variable without --enable-lora
        (True, ALL_ROUTES, True, []),
        (True, None, True, []),  # no /openapi.json: unknown, said by the first load if so
        (False, frozenset(REQUIRED_ROUTES), False, []),
    ],
)
def test_setup_names_the_flag_and_variable_an_engine_lacks_for_adapters(
    adapters: bool, routes: frozenset[str] | None, lora_on: bool, said: list[str]
):
    import structlog

    from vllm_reloader.config import EngineConfig
    from vllm_reloader.engine.capabilities import Capabilities
    from vllm_reloader.engine.serverinfo import ServerConfig
    from vllm_reloader.service import setup

    engine = EngineConfig(url="http://127.0.0.1:8000")
    from vllm_reloader.engine.serverinfo import Lora

    server = ServerConfig(
        "/models/a", sleep_mode=False, extension=True, lora=Lora(8, None) if lora_on else None
    )
    found = Capabilities("0.32.0", routes, True)
    with structlog.testing.capture_logs() as logs:
        setup.per_release(engine, False, found, server, structlog.get_logger(), adapters)
    assert [line["event"] for line in logs] == said
    assert all(
        "--enable-lora" in line["fix"] and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in line["fix"] for line in logs
    )
