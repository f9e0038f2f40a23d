"""Small safetensors checkpoints written with numpy (no torch needed), and the fixture that makes them."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import blake3
import numpy as np
import pytest
from safetensors.numpy import save_file

TENSORS: Mapping[str, tuple[int, ...]] = {
    "model.embed_tokens.weight": (16, 8),
    "model.layers.0.mlp.up_proj.weight": (32, 8),
    "lm_head.weight": (16, 8),
}
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8}


def write_weights(
    directory: Path,
    shapes: Mapping[str, tuple[int, ...]] = TENSORS,
    *,
    seed: int = 0,
    shards: int = 1,
    config: Mapping[str, object] = CONFIG,
    dtype: type[np.generic] = np.float32,
) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = sorted(shapes)
    paths = []
    for i in range(shards):
        part = {n: rng.standard_normal(shapes[n]).astype(dtype) for n in names[i::shards]}
        path = directory / (
            "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        )
        save_file(part, str(path))
        paths.append(path)
    (directory / "config.json").write_text(json.dumps(config))
    return paths


def hf_index(shards: list[Path]) -> bytes:
    """The `model.safetensors.index.json` HF `save_pretrained` writes after its shards."""
    from vllm_reloader.checkpoint.layout import read_header

    weight_map = {tensor: path.name for path in shards for tensor in read_header(path)}
    total = sum(p.stat().st_size for p in shards)
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()


def write_manifest(
    directory: Path,
    *,
    step: int | None = None,
    digests: tuple[str, ...] = ("blake3",),
    overrides: Mapping[str, object] | None = None,
) -> dict[str, object]:
    files = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != "manifest.json"):
        data = path.read_bytes()
        entry: dict[str, object] = {"path": path.relative_to(directory).as_posix(), "size": len(data)}
        if "sha256" in digests:
            entry["sha256"] = hashlib.sha256(data).hexdigest()
        if "blake3" in digests:
            entry["blake3"] = blake3.blake3(data).hexdigest()
        files.append(entry)
    manifest: dict[str, object] = {"format_version": 1, "version": directory.name, "files": files}
    if step is not None:
        manifest["step"] = step
    manifest.update(overrides or {})
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return manifest


MakeCheckpoint = Callable[..., Path]


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> MakeCheckpoint:
    """make_checkpoint("step-1", step=1, seed=..., shapes=..., shards=..., digests=...) -> dir."""

    def make(
        name: str,
        *,
        step: int | None = None,
        root: Path | None = None,
        digests: tuple[str, ...] = ("blake3",),
        **weights: object,
    ) -> Path:
        directory = (root or tmp_path / "root") / name
        write_weights(directory, **weights)  # type: ignore[arg-type]
        write_manifest(directory, step=step, digests=digests)
        return directory

    return make
