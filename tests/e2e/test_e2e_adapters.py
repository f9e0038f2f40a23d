"""LoRA adapters on a real CPU engine started with `--enable-lora`: what the adapter gate
passes loads and answers as a fresh load from disk; what it refuses is what the engine
would take and suffer from (or refuse itself)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.support.engine_fixtures import Engine, start_engine
from tests.support.peft_adapters import make_adapter
from vllm_reloader.checkpoint import adapter, layout
from vllm_reloader.config import EngineConfig
from vllm_reloader.engine.client import EngineClient
from vllm_reloader.errors import EngineCallFailed

pytestmark = pytest.mark.engine
MAX_RANK = 8


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Path, adapter.Served]]:
    from vllm_reloader.tools.tinymodel import write_checkpoint

    scratch = tmp_path_factory.mktemp("lora")
    base = write_checkpoint(scratch / "base", seed=1)
    engine = start_engine(
        base, scratch / "engine.log", api_key=None, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
        args=("--enable-lora", "--max-lora-rank", str(MAX_RANK), "--max-loras", "2"),
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
