"""What a checkpoint looks like to the engine: tensor names, shapes, dtypes, architecture.

vLLM's in-place reload copies each tensor into an existing parameter, so a checkpoint is
loadable only if this layout equals the one being served. It is read from safetensors
headers and `config.json` alone, never from tensor data, so it costs microseconds.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

# safetensors caps its header at 100 MB; anything larger is not a header.
MAX_HEADER_BYTES = 100_000_000


class LayoutUnreadable(ValueError):
    """A header or config.json could not be read as such."""


TensorSpec = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class Layout:
    tensors: Mapping[str, TensorSpec]
    arch: Mapping[str, object]


def raw_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(header length, the header's JSON object) of one safetensors file."""
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise LayoutUnreadable(f"{path.name}: too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise LayoutUnreadable(f"{path.name}: safetensors header too large")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise LayoutUnreadable(f"{path.name}: unreadable safetensors header") from exc
    if not isinstance(header, dict):
        raise LayoutUnreadable(f"{path.name}: unreadable safetensors header")
    return length, header


def read_header(path: Path) -> dict[str, TensorSpec]:
    """Tensor name → (dtype, shape) from one safetensors file's JSON header.

    Callers validate the file with `safetensors.safe_open` first; this only extracts the
    fields (the library exposes shapes only through numpy or torch, which the daemon does
    not depend on).
    """
    _, header = raw_header(path)
    try:
        return {
            name: (str(entry["dtype"]), tuple(int(n) for n in entry["shape"]))
            for name, entry in header.items()
            if name != "__metadata__"
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LayoutUnreadable(f"{path.name}: unreadable safetensors header") from exc


def size_from_header(name: str, read: Callable[[int, int], bytes], available: int) -> int | None:
    """The size a safetensors file has when whole, from its header; None while the header
    itself is not all there yet (a writer still at it). `read(start, end)` reads bytes of
    the file, local or remote; `available` is how many bytes it has now. Raises
    `LayoutUnreadable`."""
    if available < 8:
        return None
    (length,) = struct.unpack("<Q", read(0, 8))
    if length > MAX_HEADER_BYTES:
        raise LayoutUnreadable(f"{name}: safetensors header too large")
    if available < 8 + length:
        return None
    try:
        header = json.loads(read(8, 8 + length))
        ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise LayoutUnreadable(f"{name}: unreadable safetensors header") from exc
    if any(end < 0 for end in ends):
        raise LayoutUnreadable(f"{name}: negative data offset in safetensors header")
    return int(8 + length + max(ends, default=0))


def file_size_from_header(path: Path) -> int | None:
    with path.open("rb") as f:
        fd = f.fileno()
        return size_from_header(
            path.name, lambda start, end: os.pread(fd, end - start, start), os.fstat(fd).st_size
        )


def read_arch(directory: Path) -> dict[str, object]:
    path = directory / "config.json"
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_bytes())
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

    Reads the same files vLLM's loader reads: every top-level `*.safetensors`.
    """
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise LayoutUnreadable(f"{directory}: no .safetensors files")
    return read_layout(directory, files)


def _spec(spec: TensorSpec) -> str:
    dtype, shape = spec
    return f"{dtype}{list(shape)}"


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
        if ours == theirs:
            continue
        if ours is None:
            return f"tensor {name} is missing (serving has {_spec(theirs)})", name  # type: ignore[arg-type]
        if theirs is None:
            return f"tensor {name} is not in the serving model", name
        return f"tensor {name} is {_spec(ours)}, serving has {_spec(theirs)}", name
    return None
