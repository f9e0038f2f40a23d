"""PEFT-shaped LoRA adapters written with numpy (no torch): `adapter_config.json` and
`adapter_model.safetensors` with `base_model.model.<module>.lora_A/B.weight` tensors."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.support.checkpoints import TENSORS

BASE = {name: shape for name, shape in TENSORS.items()}
"""The test model's weights (tests.support.checkpoints): the adapters below adapt them."""
MODULES = ("model.layers.0.mlp.up_proj",)


def write_adapter(
    directory: Path,
    *,
    rank: int = 4,
    alpha: float = 8,
    modules: tuple[str, ...] = MODULES,
    targets: object = ("up_proj",),
    seed: int = 0,
    scale: float = 0.01,
    overrides: Mapping[str, np.ndarray] = {},
    config: Mapping[str, object] = {},
    base: Mapping[str, tuple[int, ...]] = BASE,
) -> Path:
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for module in modules:
        out, inner = base[f"{module}.weight"]
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, inner)) * scale).astype(np.float32)
        tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((out, rank)) * scale).astype(np.float32)
    tensors.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, **config}
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory
