"""The gate for a LoRA adapter: each check refuses what vLLM would load and suffer from."""

import dataclasses
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.adapters import BASE, MODULES, write_adapter
from vllm_reloader.checkpoint import adapter

SERVED = adapter.Served(weights=BASE, dtype="BF16", max_rank=8, model="org/tiny-llama")
UP_A = f"base_model.model.{MODULES[0]}.lora_A.weight"
UP_B = f"base_model.model.{MODULES[0]}.lora_B.weight"


def test_adapter_gate_passes_a_well_made_adapter(tmp_path):
    verdict = adapter.check(write_adapter(tmp_path / "v1"), SERVED)
    assert (verdict.status, verdict.rank, verdict.modules) == ("ready", 4, 1)
    assert set(verdict.files) == {"adapter_config.json", "adapter_model.safetensors"}, (
        "compared before the load"
    )


def test_adapter_gate_never_runs_an_adapters_regex_but_still_checks_its_modules(tmp_path):
    """A `target_modules` regex is the writer's own (vLLM ignores it): never compiled or run
    here (this one would backtrack for minutes, and does not even compile), while the modules
    themselves are still checked against the served model."""
    never_run = r"(.|.)*(?:(?:.*)*)*X("
    with pytest.raises(re.error):
        re.compile(never_run)
    assert adapter.check(write_adapter(tmp_path / "a", targets=never_run), SERVED).status == "ready"
    gate = "model.layers.0.mlp.gate_proj"  # not in the served model
    outside = write_adapter(
        tmp_path / "b", targets=never_run, modules=(gate,), base={**BASE, f"{gate}.weight": (32, 8)}
    )
    assert adapter.check(outside, SERVED).check == "modules"


@pytest.mark.parametrize(
    ("made", "check", "said"),
    [
        ({"rank": 16}, "rank", "over the engine's max LoRA rank 8"),
        (
            {
                "modules": ("model.layers.0.mlp.gate_proj",),
                "base": {**BASE, "model.layers.0.mlp.gate_proj.weight": (32, 8)},
            },
            "modules",
            "not a module of the served model",
        ),
        ({"targets": ("down_proj",)}, "modules", "not one of adapter_config.json's target_modules"),
        (
            {"overrides": {UP_A: np.zeros((4, 9), np.float32)}},
            "shapes",
            "do not adapt the served weight [32, 8]",
        ),
        ({"overrides": {UP_B: np.zeros((32, 3), np.float32)}}, "shapes", "at r = 4"),
        ({"overrides": {UP_A: np.zeros((4, 8), np.float64)}}, "dtype", "is F64"),
        (
            {"overrides": {"base_model.model.lm_head.weight": np.zeros((16, 8), np.float32)}},
            "modules",
            "not a LoRA",
        ),
        ({"config": {"peft_type": "IA3"}}, "config", "not LORA"),
        ({"config": {"r": 0}}, "config", "r must be a positive integer"),
        ({"config": {"use_dora": True}}, "config", "DoRA is set"),
        ({"config": {"bias": "all"}}, "config", "without biases only"),
        ({"config": {"modules_to_save": ["lm_head"]}}, "config", "modules_to_save is set"),
        ({"config": {"use_rslora": "yes"}}, "config", "use_rslora must be true or false"),
        ({"config": {"rank_pattern": {".*up_proj": 2}}}, "config", "is a regex"),
        ({"config": {"rank_pattern": {"up_proj": 16}}}, "rank", "r = 16 is over"),
        ({"config": {"lora_alpha": "eight"}}, "config", "lora_alpha must be a finite number"),
    ],
)
def test_adapter_gate_rejects_naming_the_check(tmp_path, made, check, said):
    verdict = adapter.check(write_adapter(tmp_path / "v", **made), SERVED)
    assert (verdict.status, verdict.check) == ("rejected", check), verdict
    assert said in verdict.reason and "\n" not in verdict.reason


def test_adapter_gate_rejects_a_missing_half(tmp_path):
    from safetensors.numpy import save_file

    directory = write_adapter(tmp_path / "v")
    save_file({UP_A: np.zeros((4, 8), np.float32)}, str(directory / "adapter_model.safetensors"))
    verdict = adapter.check(directory, SERVED)
    assert verdict.check == "modules" and "lora_B is missing" in verdict.reason


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "vocab_size": 16}


@pytest.mark.parametrize(
    "trained_on",
    [
        "org/another-name",
        "models/base",
        "/models/not-here",
        "/same-weights-elsewhere",
        "/a\0b",
        "/another-model-outside-the-root",
    ],
)
def test_adapter_gate_judges_the_base_model_by_weights_not_by_the_name_peft_recorded(tmp_path, trained_on):
    """The engine serves the published copy (`.../checkpoints/step-0`); PEFT recorded the hub id,
    a relative path or another copy of the same model the trainer loaded."""
    served_dir = tmp_path / "checkpoints" / "step-0"
    served_dir.mkdir(parents=True)
    (served_dir / "config.json").write_text(json.dumps(LLAMA))
    if trained_on == "/same-weights-elsewhere":  # beside it: opened, and the same model
        trained_on = str(tmp_path / "checkpoints" / "base")
        Path(trained_on).mkdir(parents=True)
        (Path(trained_on) / "config.json").write_text(json.dumps(LLAMA))
    if trained_on == "/another-model-outside-the-root":  # never opened: the shapes decide
        trained_on = str(tmp_path / "elsewhere" / "big")
        Path(trained_on).mkdir(parents=True)
        (Path(trained_on) / "config.json").write_text(json.dumps({**LLAMA, "hidden_size": 4096}))
    served = dataclasses.replace(SERVED, model=str(served_dir))
    named = write_adapter(tmp_path / "v", config={"base_model_name_or_path": trained_on})
    assert adapter.check(named, served).status == "ready"


def test_adapter_gate_rejects_a_base_model_whose_config_is_another_model(tmp_path):
    served_dir, other = tmp_path / "checkpoints" / "step-0", tmp_path / "checkpoints" / "big-model"
    for directory, config in ((served_dir, LLAMA), (other, {**LLAMA, "hidden_size": 4096})):
        directory.mkdir(parents=True)
        (directory / "config.json").write_text(json.dumps(config))
    served = dataclasses.replace(SERVED, model=str(served_dir))
    trained = write_adapter(tmp_path / "v", config={"base_model_name_or_path": str(other)})
    verdict = adapter.check(trained, served)
    assert (verdict.status, verdict.check) == ("rejected", "base_model")
    assert "whose hidden_size is 4096" in verdict.reason and "is 8" in verdict.reason
    assert "train it on the served model, or serve the model it was trained on" in verdict.reason


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_adapter_gate_rejects_non_finite_weights(tmp_path, bad):
    values = np.full((32, 4), 0.01, np.float32)
    values[31, 3] = bad
    verdict = adapter.check(write_adapter(tmp_path / "v", overrides={UP_B: values}), SERVED)
    assert verdict.check == "non_finite" and UP_B in verdict.reason


def test_adapter_gate_rejects_finite_weights_whose_update_overflows_the_serving_dtype(tmp_path):
    """vLLM 0.32 took such an adapter (lora_B at ±3e38) and then failed every request."""
    values = np.full((32, 4), 3e38, np.float32)
    verdict = adapter.check(write_adapter(tmp_path / "v", overrides={UP_B: values}, scale=1.0), SERVED)
    assert verdict.check == "overflow" and MODULES[0] in verdict.reason and "BF16" in verdict.reason


def test_adapter_gate_gives_cancelling_factors_no_credit(tmp_path):
    """vLLM computes (x·Aᵀ)·Bᵀ, never B·A: rows of B that cancel against A still overflow
    there, so the bound (max row sum of |B·scale| x max |A|) decides, not the product."""
    served = adapter.Served(weights=BASE, dtype="F16", max_rank=8)
    b = np.tile(np.array([[300.0, -300.0, 0.0, 0.0]], np.float32), (32, 1))
    a = np.full((4, 8), 300.0, np.float32)
    verdict = adapter.check(write_adapter(tmp_path / "v", overrides={UP_A: a, UP_B: b}, alpha=4), served)
    assert verdict.check == "overflow" and "the update" in verdict.reason and "1.8e+05" in verdict.reason


@pytest.mark.parametrize(
    ("a", "b", "alpha", "said"),
    [
        (1e6, 1e-8, 4, "lora_A reaches 1e+06"),  # A alone overflows float16 once converted
        (1e-6, 6e4, 8, "lora_B x scale reaches 1.2e+05"),  # B times its scale (2) does
    ],
)
def test_adapter_gate_rejects_a_factor_out_of_the_serving_dtypes_range(tmp_path, a, b, alpha, said):
    served = adapter.Served(weights=BASE, dtype="F16", max_rank=8)
    tensors = {UP_A: np.full((4, 8), a, np.float32), UP_B: np.full((32, 4), b, np.float32)}
    verdict = adapter.check(write_adapter(tmp_path / "v", overrides=tensors, alpha=alpha), served)
    assert verdict.check == "overflow" and said in verdict.reason


def test_adapter_gate_applies_alpha_pattern_and_rank_pattern_per_module(tmp_path):
    huge = write_adapter(tmp_path / "alpha", config={"alpha_pattern": {"up_proj": 1e42}})
    assert adapter.check(huge, SERVED).check == "overflow"
    narrow = write_adapter(tmp_path / "rank", rank=2, config={"r": 4, "rank_pattern": {"up_proj": 2}})
    assert adapter.check(narrow, SERVED).status == "ready"


def test_adapter_gate_rejects_a_module_adapted_twice_under_two_names(tmp_path):
    """vLLM takes names with and without `base_model.model.`: it would load one copy, while a
    gate keeping the other would have checked only that one."""
    nan = np.full((4, 8), np.nan, np.float32)
    directory = write_adapter(tmp_path / "v", overrides={f"{MODULES[0]}.lora_A.weight": nan})
    verdict = adapter.check(directory, SERVED)
    assert verdict.check == "modules" and "twice" in verdict.reason


def test_adapter_gate_rejects_a_header_whose_offsets_do_not_fit_the_shapes(tmp_path):
    directory = write_adapter(tmp_path / "v")
    weights = directory / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header[UP_A]["shape"] = [4, 16]  # 64 values where the bytes hold 32
    encoded = json.dumps(header).encode()
    weights.write_bytes(len(encoded).to_bytes(8, "little") + encoded + bytes(data[8 + length :]))
    verdict = adapter.check(directory, SERVED)
    assert verdict.status == "rejected" and verdict.check == "shapes"


def test_adapter_gate_waits_for_files_still_being_written(tmp_path):
    directory = write_adapter(tmp_path / "v")
    (directory / "adapter_model.safetensors").unlink()
    assert adapter.check(directory, SERVED).status == "pending"
    write_adapter(directory)
    (directory / "adapter_config.json").write_text('{"r": 4, "lora_al')
    assert adapter.check(directory, SERVED).status == "pending"
    later = adapter.check(directory, SERVED, now=time.time() + 60)  # never finished
    assert later.check == "config" and "is not JSON" in later.reason
    weights = directory / "adapter_model.safetensors"
    whole = weights.read_bytes()
    write_adapter(directory)  # a writer that puts the config first, then the weights
    weights.write_bytes(whole[: len(whole) - 100])
    short = adapter.check(directory, SERVED)
    assert short.status == "pending" and "shorter than its header" in short.reason


@pytest.mark.parametrize("config", ["[" * 100_000, json.dumps({"r": 4, "pad": "x" * (2 << 20)})])
def test_adapter_gate_rejects_a_config_nested_too_deep_or_too_large_without_stopping(tmp_path, config):
    directory = write_adapter(tmp_path / "v")
    (directory / "adapter_config.json").write_text(config)
    verdict = adapter.check(directory, SERVED)
    assert verdict.status in ("rejected", "pending") and "\n" not in verdict.reason
