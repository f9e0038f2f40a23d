"""LoRA adapters on a real CPU engine started with `--enable-lora`: what the adapter gate
passes loads and answers as a fresh load from disk; what it refuses is what the engine
would take and suffer from (or refuse itself)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import structlog
from safetensors.numpy import load_file, save_file

from tests.support import background
from tests.support.engine_fixtures import DaemonProcess, Engine, daemon_config, start_engine
from tests.support.peft_adapters import make_adapter
from tests.support.records import open_records
from vllm_reloader.checkpoint import adapter, layout
from vllm_reloader.config import EngineConfig, RolloutConfig
from vllm_reloader.engine.client import EngineClient
from vllm_reloader.errors import EngineCallFailed
from vllm_reloader.sources import verdicts
from vllm_reloader.sources.filestore import open_store

pytestmark = pytest.mark.engine
MAX_RANK = 8


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Path, adapter.Served]]:
    from vllm_reloader.tools.tinymodel import write_checkpoint

    scratch = tmp_path_factory.mktemp("lora")
    base = write_checkpoint(scratch / "base", seed=1)
    engine = start_engine(
        base, scratch / "engine.log", api_key=None, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
        args=("--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "2", "--max-cpu-loras", "3"),
    )  # fmt: skip
    weights = {name: shape for name, (_, shape) in layout.read_header(base / "model.safetensors").items()}
    try:
        yield engine, base, adapter.Served(weights=weights, dtype="BF16", max_rank=MAX_RANK)
    finally:
        engine.stop()


def test_e2e_gated_adapter_versions_load_in_place_and_answer_as_a_fresh_load(lora, tmp_path):
    engine, base, served = lora
    versions = [make_adapter(base, tmp_path / "support" / f"v{n}", seed=n) for n in (1, 2)]
    assert [adapter.check(v, served).status for v in versions] == ["ready", "ready"]
    client = EngineClient(EngineConfig(url=engine.url))
    base_answers = engine.complete()
    client.load_adapter("support", str(versions[0]))
    first = engine.complete("support")
    assert first != base_answers, "the adapter changes the answers"
    client.load_adapter("support", str(versions[1]))  # in place, under the same name
    second = engine.complete("support")
    client.load_adapter("fresh", str(versions[1]))
    assert second == engine.complete("fresh") != first
    assert engine.complete() == base_answers, "base-model requests are untouched"
    client.unload_adapter("fresh")
    client.unload_adapter("support")


def _edited(source: Path, into: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(source, into)
    tensors = load_file(str(into / "adapter_model.safetensors"))
    edit(tensors)
    save_file(tensors, str(into / "adapter_model.safetensors"))
    return into


def test_e2e_adapter_gate_refuses_nan_exploding_and_over_rank_adapters(lora, tmp_path):
    engine, base, served = lora
    good = make_adapter(base, tmp_path / "good", seed=5)
    b_name = next(n for n in load_file(str(good / "adapter_model.safetensors")) if ".lora_B." in n)

    def nan(tensors: dict[str, np.ndarray]) -> None:
        tensors[b_name] = tensors[b_name].copy()
        tensors[b_name][0, 0] = np.nan

    def exploding(tensors: dict[str, np.ndarray]) -> None:  # finite on disk
        tensors[b_name] = np.full_like(tensors[b_name], 3e38)

    assert adapter.check(_edited(good, tmp_path / "nan", nan), served).check == "non_finite"
    assert adapter.check(_edited(good, tmp_path / "boom", exploding), served).check == "overflow"
    wide = make_adapter(base, tmp_path / "wide", seed=6, rank=16)
    verdict = adapter.check(wide, served)
    assert verdict.check == "rank" and "max LoRA rank 8" in verdict.reason
    with pytest.raises(EngineCallFailed, match="max_lora_rank"):  # the engine refuses this one itself
        EngineClient(EngineConfig(url=engine.url)).load_adapter("wide", str(wide))
    assert engine.healthy()


class AdapterTraffic:
    """Clients asking an adapter and the base model back to back; `quiet()` holds them while
    the test compares answers (greedy answers are compared one request at a time)."""

    def __init__(self, engine: Engine, models: tuple[str, ...]) -> None:
        self.engine, self.models = engine, models
        self.stop, self.go = threading.Event(), threading.Event()
        self.go.set()
        self.idle = threading.Event()
        self.answered: dict[str, int] = dict.fromkeys(models, 0)
        self.failed: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.engine.url, timeout=120) as http:
            turn = 0
            while not self.stop.is_set():
                if not self.go.is_set():
                    self.idle.set()
                    self.go.wait(0.1)
                    continue
                self.idle.clear()
                model, turn = self.models[turn % len(self.models)], turn + 1
                body = {"model": model, "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0}
                try:
                    response = http.post("/v1/completions", json=body)
                    if response.status_code == 200:
                        self.answered[model] += 1
                    else:
                        self.failed.append(f"{model}: HTTP {response.status_code}: {response.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failed.append(f"{model}: {exc!r}")

    @contextmanager
    def quiet(self) -> Iterator[None]:
        self.go.clear()
        assert self.idle.wait(120), "a client request did not come back"
        try:
            yield
        finally:
            self.go.set()


def _landed(root: Path, name: str, version: str, made: Path) -> Path:
    """A version renamed into the adapter root whole, as a trainer's last step does."""
    (root / name).mkdir(parents=True, exist_ok=True)
    return made.rename(root / name / version)


def test_e2e_daemon_lands_adapter_versions_under_load_rejects_bad_ones_and_rolls_back(lora, tmp_path):
    engine, base, _ = lora
    staged, root = tmp_path / "staged", tmp_path / "adapters"
    made = {f"alpha-{n}": make_adapter(base, staged / f"alpha-{n}", seed=10 + n) for n in (1, 2, 3)}
    made |= {f"beta-{n}": make_adapter(base, staged / f"beta-{n}", seed=20 + n) for n in (1,)}
    client = EngineClient(EngineConfig(url=engine.url))

    def fresh(source: Path) -> list[str]:  # that version loaded from disk under a new name
        name = f"fresh-{source.name}"
        client.load_adapter(name, str(source))
        try:
            return engine.complete(name)
        finally:
            client.unload_adapter(name)

    expected = {name: fresh(path) for name, path in made.items()}
    base_answers = engine.complete()
    config = daemon_config(
        tmp_path / "d.toml", root=tmp_path / "root", engine_url=engine.url, state_dir=tmp_path / "state"
    )
    root.mkdir()
    config.write_text(
        config.read_text() + f'[adapters]\nroot = "{root}"\nmax_rank = {MAX_RANK}\ninterval = 0.2\n'
    )
    daemon = DaemonProcess(config)
    try:
        daemon.wait_for("engine.reconciled", timeout=120)
        _landed(root, "alpha", "step-1", made["alpha-1"])
        daemon.wait_for("adapter.loaded", adapter="alpha", version="step-1", timeout=120)
        assert engine.complete("alpha") == expected["alpha-1"]

        traffic = AdapterTraffic(engine, ("alpha", "tiny"))
        with background.running([traffic.thread], traffic.stop, join_s=150):
            _landed(root, "alpha", "step-2", made["alpha-2"])
            daemon.wait_for("adapter.loaded", adapter="alpha", version="step-2", timeout=120)
            with traffic.quiet():
                assert engine.complete("alpha") == expected["alpha-2"]
            _landed(root, "alpha", "step-3", made["alpha-3"])  # two adapters at once
            _landed(root, "beta", "step-1", made["beta-1"])
            daemon.wait_for("adapter.loaded", adapter="alpha", version="step-3", timeout=120)
            daemon.wait_for("adapter.loaded", adapter="beta", version="step-1", timeout=120)
            with traffic.quiet():
                assert engine.complete("alpha") == expected["alpha-3"]
                assert engine.complete("beta") == expected["beta-1"]

            served = root / "alpha" / "step-3"
            b_name = next(n for n in load_file(str(served / "adapter_model.safetensors")) if ".lora_B." in n)

            def nan(tensors: dict[str, np.ndarray]) -> None:
                tensors[b_name] = tensors[b_name].copy()
                tensors[b_name][0, 0] = np.nan

            def exploding(tensors: dict[str, np.ndarray]) -> None:  # finite on disk, refused by the gate
                tensors[b_name] = np.full_like(tensors[b_name], 3e38)

            def diverged(tensors: dict[str, np.ndarray]) -> None:  # passes the gate, not the canary
                for name in tensors:
                    tensors[name] = np.full_like(tensors[name], 1e9)

            _landed(root, "alpha", "step-4", _edited(served, staged / "nan", nan))
            _landed(root, "alpha", "step-5", _edited(served, staged / "boom", exploding))
            _landed(root, "beta", "step-2", make_adapter(base, staged / "wide", seed=30, rank=16))
            assert daemon.wait_for("adapter.rejected", version="step-4", timeout=60)["check"] == "non_finite"
            assert daemon.wait_for("adapter.rejected", version="step-5", timeout=60)["check"] == "overflow"
            assert (
                daemon.wait_for("adapter.rejected", adapter="beta", version="step-2", timeout=60)["check"]
                == "rank"
            )
            _landed(root, "alpha", "step-6", _edited(served, staged / "diverged", diverged))
            rolled = daemon.wait_for("adapter.rolled_back", adapter="alpha", version="step-6", timeout=120)
            assert rolled["to_version"] == "step-3" and rolled["blamed"] is True, rolled
            assert rolled["cause"] == "probe", "found before it was loaded: no client request reached it"
            with traffic.quiet():
                assert engine.complete("alpha") == expected["alpha-3"], "the last good version serves again"
                assert engine.complete() == base_answers, "the base model is untouched"
        assert traffic.failed == [], traffic.failed[:5]
        assert traffic.answered["alpha"] > 0 and traffic.answered["tiny"] > 0
        assert not daemon.events("adapter.loaded", version="step-4") + daemon.events(
            "adapter.loaded", version="step-5"
        )
        loads = [e for e in daemon.events("adapter.loading", adapter="alpha") if e["version"] == "step-6"]
        assert len(loads) == 1 and not daemon.events("adapter.loaded", version="step-6")
        probed = daemon.events("adapter.loaded", adapter="alpha")
        assert probed and all(e.get("probe_ms") is not None for e in probed), "every version was probed"
    finally:
        assert daemon.stop() == 0
        for name in ("alpha", "beta"):
            with contextlib.suppress(EngineCallFailed):
                client.unload_adapter(name)


def test_e2e_daemon_serves_adapter_versions_uploaded_to_an_object_store(lora, tmp_path, bucket):
    """The same gate and swap with the versions in S3 (moto): each is downloaded into the
    daemon's copies, hashed as read, and loaded from there."""
    engine, base, _ = lora
    made = {n: make_adapter(base, tmp_path / "staged" / f"v{n}", seed=40 + n) for n in (1, 2)}
    client = EngineClient(EngineConfig(url=engine.url))
    client.load_adapter("fresh-remote", str(made[2]))
    expected = engine.complete("fresh-remote")
    client.unload_adapter("fresh-remote")
    config = daemon_config(
        tmp_path / "d.toml", root=tmp_path / "root", engine_url=engine.url, state_dir=tmp_path / "state"
    )
    config.write_text(
        config.read_text()
        + f'[adapters]\nroot = "{bucket.url}/adapters"\nmax_rank = {MAX_RANK}\ninterval = 0.2\n'
    )
    daemon = DaemonProcess(config)
    try:
        daemon.wait_for("engine.reconciled", timeout=120)
        for n, version in made.items():  # the weights first, the config last, as a careful uploader
            for file in ("adapter_model.safetensors", "adapter_config.json"):
                bucket.put(f"adapters/gamma/step-{n}/{file}", (version / file).read_bytes())
            daemon.wait_for("adapter.loaded", adapter="gamma", version=f"step-{n}", timeout=120)
        assert engine.complete("gamma") == expected
        served = Path(client.adapters()["gamma"])
        assert served.parent == tmp_path / "state" / "adapters" / "gamma", served
        assert served.name.startswith("step-2@"), served
    finally:
        assert daemon.stop() == 0
        with contextlib.suppress(EngineCallFailed):
            client.unload_adapter("gamma")


def test_e2e_follower_loads_an_adapter_only_once_a_canary_host_passed_it_and_goes_back_on_recall(
    lora, tmp_path, bucket
):
    """A follower host's daemon on the real engine; the canary host's records are written as
    a canary host's daemon writes them (`verdicts.Fleet`)."""
    engine, base, _ = lora
    version = make_adapter(base, tmp_path / "staged" / "v1", seed=50)
    client = EngineClient(EngineConfig(url=engine.url))
    config = daemon_config(
        tmp_path / "d.toml", root=tmp_path / "root", engine_url=engine.url, state_dir=tmp_path / "state"
    )
    text = config.read_text().replace(
        f'path = "{tmp_path / "root"}"', f'path = "{bucket.url}/checkpoints"', 1
    )
    config.write_text(
        text + f'[adapters]\nroot = "{bucket.url}/adapters"\nmax_rank = {MAX_RANK}\ninterval = 0.2\n'
        '[rollout]\nrole = "follow"\nhost = "follower-1"\n'
    )
    (tmp_path / "canary-host").mkdir()
    canary_host = verdicts.Fleet(
        open_store(f"{bucket.url}/adapters"),
        RolloutConfig(host="canary-1"),
        structlog.get_logger(),
        open_records(tmp_path / "canary-host"),
    )
    daemon = DaemonProcess(config)
    try:
        daemon.wait_for("engine.reconciled", timeout=120)
        for file in ("adapter_model.safetensors", "adapter_config.json"):
            bucket.put(f"adapters/delta/step-1/{file}", (version / file).read_bytes())
        waiting = daemon.wait_for("adapter.waiting", adapter="delta", timeout=60)
        assert "delta" not in client.adapters(), "not loaded before a canary host passed it"
        command = [sys.executable, "-m", "vllm_reloader", "status", "--config", str(config)]
        shown = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
        assert "waiting step-1: waiting for canary hosts" in shown, shown
        canary_host.add(verdicts.Verdict("delta", "step-1", waiting["fingerprint"], True))
        assert canary_host.write_queued()
        daemon.wait_for("adapter.loaded", adapter="delta", version="step-1", timeout=60)
        assert "delta" in client.adapters()
        failed = verdicts.Verdict("delta", "step-1", waiting["fingerprint"], False, "its canary failed: NaN")
        canary_host.add(failed)
        assert canary_host.write_queued()
        daemon.wait_for("adapter.recalled", adapter="delta", timeout=60)
        daemon.wait_for("adapter.unloaded", adapter="delta", cause="rejected", timeout=60)
        assert "delta" not in client.adapters(), "nothing good to go back to: unloaded"
    finally:
        assert daemon.stop() == 0
        with contextlib.suppress(EngineCallFailed):
            client.unload_adapter("delta")
