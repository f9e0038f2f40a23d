"""What a checkpoint looks like to the engine: tensor names, shapes, dtypes, architecture.

vLLM's in-place reload copies each tensor into an existing parameter, so a checkpoint is
loadable only if its names and shapes equal the ones being served. Dtypes are compared by
what that copy converts: the weight loaders `copy_` a float32, float16 or bfloat16 tensor
into a parameter of any of the three (a Hugging Face `Trainer` saves float32 for a bf16
engine), while quantized and integer tensors (FP8, INT8, packed formats and their scales)
are read bit for bit and must match exactly. It is read from safetensors headers and
`config.json` alone, never from tensor data, so it costs microseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import LayoutUnreadable
from .files import Header, is_top_level_shard, parse_json, read_small, tensors_of, through_links

# The fields of config.json that fix the model's structure. Others (rope scaling, token
# ids, dtype) either show up in the tensor shapes or are not reloaded by the engine at all.
ARCH_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)

TensorSpec = tuple[str, tuple[int, ...]]
CONVERTED_ON_COPY = frozenset({"F32", "F16", "BF16"})
"""Dtypes a vLLM weight loader converts between when it copies a tensor into a parameter."""


@dataclass(frozen=True)
class Layout:
    tensors: Mapping[str, TensorSpec]
    arch: Mapping[str, object]


def read_header(path: Path) -> dict[str, TensorSpec]:
    """Tensor name → (dtype, shape) of one safetensors file, from its header alone."""
    return {t.name: (t.dtype, t.shape) for t in tensors_of(path)}


def from_headers(headers: Iterable[Header], arch: Mapping[str, object]) -> Layout:
    return Layout(tensors={t.name: (t.dtype, t.shape) for h in headers for t in h.tensors}, arch=arch)


def read_arch(directory: Path, *, follow_symlinks: bool = False) -> dict[str, object]:
    path = directory / "config.json"
    try:
        data = read_small(through_links(path, trusted=follow_symlinks))
    except FileNotFoundError:
        return {}
    try:
        config = parse_json(data)
    except ValueError as exc:
        raise LayoutUnreadable("config.json is not valid JSON") from exc
    if not isinstance(config, dict):
        raise LayoutUnreadable("config.json is not a JSON object")
    return {key: config[key] for key in ARCH_FIELDS if key in config}


def read_layout(directory: Path, weight_files: Iterable[Path]) -> Layout:
    tensors: dict[str, TensorSpec] = {}
    for path in weight_files:
        tensors.update(read_header(path))
    return Layout(tensors=tensors, arch=read_arch(directory))


def read_served_layout(directory: Path) -> Layout:
    """Layout of a checkpoint the engine loaded, manifest or not (e.g. its startup model).

    Reads the same files vLLM's loader reads: every top-level `*.safetensors`. The engine's
    own model is trusted, so symlinks are followed: a Hugging Face cache snapshot links every
    file to its blob.
    """
    files = sorted(p for p in directory.iterdir() if is_top_level_shard(p.name))
    if not files:
        raise LayoutUnreadable(f"{directory}: no .safetensors files")
    tensors: dict[str, TensorSpec] = {}
    for path in files:
        tensors.update(read_header(through_links(path, trusted=True)))
    return Layout(tensors=tensors, arch=read_arch(directory, follow_symlinks=True))


def _spec(spec: TensorSpec) -> str:
    dtype, shape = spec
    return f"{dtype}{list(shape)}"


def loadable_into(ours: TensorSpec, theirs: TensorSpec) -> bool:
    """Same shape, and a dtype the engine's copy converts (or the same dtype)."""
    (our_dtype, our_shape), (their_dtype, their_shape) = ours, theirs
    if our_shape != their_shape:
        return False
    return our_dtype == their_dtype or {our_dtype, their_dtype} <= CONVERTED_ON_COPY


def first_difference(candidate: Layout, serving: Layout) -> tuple[str, str | None] | None:
    """None when loadable; else (reason, tensor name or None) naming the first difference."""
    for key in ARCH_FIELDS:
        if candidate.arch and serving.arch and candidate.arch.get(key) != serving.arch.get(key):
            return (
                f"config.json {key} is {candidate.arch.get(key)!r}, serving has {serving.arch.get(key)!r}",
                None,
            )
    for name in sorted(candidate.tensors.keys() | serving.tensors.keys()):
        ours, theirs = candidate.tensors.get(name), serving.tensors.get(name)
        if ours == theirs or (ours and theirs and loadable_into(ours, theirs)):
            continue
        if ours is None:
            return f"tensor {name} is missing (serving has {_spec(theirs)})", name  # type: ignore[arg-type]
        if theirs is None:
            return f"tensor {name} is not in the serving model", name
        return f"tensor {name} is {_spec(ours)}, serving has {_spec(theirs)}", name
    return None
