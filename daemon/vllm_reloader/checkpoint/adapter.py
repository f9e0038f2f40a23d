"""The gate for a LoRA adapter (PEFT's files): whether it may load into the model served.

vLLM checks little when it loads an adapter at run time, and a loaded adapter takes part in
every request on the engine: one of NaN weights made every base-model request fail; one
finite on disk whose update overflows (`lora_B` holding ±3e38) made every request fail,
the other adapters' included (vLLM 0.32, CPU). So nothing loads on a guess:

- `adapter_config.json` read within bounds (size, nesting) and its schema checked: `r`, at
  most the engine's `--max-lora-rank`; `lora_alpha`; `target_modules` (names or a regex);
  `base_model_name_or_path` matching the model served, when both are known.
- `adapter_model.safetensors`: every tensor a `lora_A`/`lora_B` pair of a module that
  exists in the served model and matches its target modules, `A` of shape (r, in) and `B`
  of (out, r) for a base weight of (out, in), in a dtype the engine takes.
- Every value finite, and the update each pair makes, `B·A·alpha/r` (`alpha/√r` with
  rsLoRA), within the serving dtype's range: bounded cheaply first (max row sum of |B| times
  max |A|), computed exactly, a block of rows at a time, only where the bound is over.

A verdict is data, as the checkpoint gate's: `ready`, `pending` (a file missing or short:
still being written) or `rejected` with the check that failed.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import LayoutUnreadable
from .files import Tensor, open_regular, parse_json, read_exactly, read_small, tensors_of

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
TAKEN_DTYPES = frozenset({"F32", "F16", "BF16"})
"""What vLLM's LoRA loader takes (it converts to the LoRA dtype)."""
DTYPE_MAX = {"F32": float(np.finfo(np.float32).max), "BF16": 3.3895e38, "F16": 65504.0}
PREFIX = "base_model.model."
_PAIR = re.compile(r"(?P<module>.+)\.lora_(?P<part>[AB])(?:\.(?P<adapter>[^.]+))?\.weight")
ROWS = 1024
"""Rows of B multiplied at a time in the exact check (bounds its memory: ROWS x in floats)."""


@dataclass(frozen=True)
class Served:
    """What the engine serves, as an adapter is compared with it."""

    weights: Mapping[str, tuple[int, ...]]
    """The base model's weight shapes by tensor name (its checkpoint's headers)."""
    dtype: str = "BF16"
    """The serving dtype (`DTYPE_MAX`): an update beyond its range overflows."""
    max_rank: int = 16
    model: str | None = None
    """The base model's name or path, as an adapter's config would name it (None: not compared)."""


@dataclass(frozen=True)
class AdapterVerdict:
    status: str
    reason: str = ""
    check: str = ""
    """For `rejected`: which check failed (`config`, `rank`, `modules`, `shapes`, `dtype`,
    `base_model`, `non_finite`, `overflow`)."""
    rank: int = 0
    modules: int = 0
    details: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    rank: int
    alpha: float
    targets: tuple[str, ...] | str
    """Module name suffixes, or one regex that must match a whole module name (PEFT's rule)."""
    rslora: bool
    base_model: str | None

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def targets_module(self, module: str) -> bool:
        if isinstance(self.targets, str):
            return re.fullmatch(self.targets, module) is not None
        return any(module == t or module.endswith("." + t) for t in self.targets)


def _rejected(check: str, reason: str, **details: object) -> AdapterVerdict:
    return AdapterVerdict("rejected", reason, check, details=dict(details))


def parse_config(data: bytes) -> Config:
    """Raises `json.JSONDecodeError` (not JSON) or `ValueError` (one line: what is wrong)."""
    found = parse_json(data)
    if not isinstance(found, dict):
        raise ValueError(f"{CONFIG_NAME} is not a JSON object")
    peft_type = found.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{CONFIG_NAME}: peft_type {str(peft_type)[:40]!r}, not LORA")
    rank, alpha = found.get("r"), found.get("lora_alpha", found.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank <= 1 << 16:
        raise ValueError(f"{CONFIG_NAME}: r must be a positive integer, not {str(rank)[:40]}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"{CONFIG_NAME}: lora_alpha must be a finite number, not {str(alpha)[:40]}")
    targets = found.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as exc:
            raise ValueError(f"{CONFIG_NAME}: target_modules is not a valid regex: {exc}") from None
        chosen: tuple[str, ...] | str = targets
    elif isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        chosen = tuple(targets)
    else:
        raise ValueError(f"{CONFIG_NAME}: target_modules must be a list of module names or a regex")
    base = found.get("base_model_name_or_path")
    return Config(
        rank, float(alpha), chosen, found.get("use_rslora") is True, base if isinstance(base, str) else None
    )


def check(
    directory: Path, served: Served, *, now: float | None = None, grace: float = 10.0
) -> AdapterVerdict:
    """Judge one adapter version's directory against what the engine serves. A config that is
    not whole JSON may still be written for `grace` seconds after it last changed."""
    try:
        return _check(directory, served, time.time() if now is None else now, grace)
    except FileNotFoundError as exc:
        return AdapterVerdict("pending", f"{Path(exc.filename or directory).name} is not there yet")
    except LayoutUnreadable as exc:
        return _rejected("shapes", str(exc))
    except OSError as exc:
        where = Path(exc.filename).name if exc.filename else WEIGHTS_NAME
        return _rejected("io", f"cannot read {where}: {exc.strerror or exc}")


def _check(directory: Path, served: Served, now: float, grace: float) -> AdapterVerdict:
    path = directory / CONFIG_NAME
    try:
        config = parse_config(read_small(path, MAX_CONFIG_BYTES))
    except json.JSONDecodeError as exc:
        if now - path.stat().st_mtime < grace:
            return AdapterVerdict("pending", f"{CONFIG_NAME} is not whole JSON yet (may still be written)")
        return _rejected("config", f"{CONFIG_NAME} is not JSON: {exc}")
    except ValueError as exc:
        return _rejected("config", str(exc))
    if config.rank > served.max_rank:
        return _rejected(
            "rank",
            f"r = {config.rank} is over the engine's max LoRA rank {served.max_rank} (--max-lora-rank)",
        )
    if served.model and config.base_model and _model_name(config.base_model) != _model_name(served.model):
        return _rejected(
            "base_model", f"trained on {config.base_model[:200]!r}, the engine serves {served.model[:200]!r}"
        )
    tensors = tensors_of(directory / WEIGHTS_NAME)
    size, end = (directory / WEIGHTS_NAME).stat().st_size, max((t.end for t in tensors), default=0)
    if size < end:
        return AdapterVerdict(
            "pending", f"{WEIGHTS_NAME} is shorter than its header says (still being written)"
        )
    pairs = _pairs(tensors)
    if isinstance(pairs, AdapterVerdict):
        return pairs
    for module, (a, b) in pairs.items():
        if problem := _shape_problem(module, a, b, config, served):
            return problem
    limit = DTYPE_MAX.get(served.dtype, DTYPE_MAX["F16"])
    fd = open_regular(directory / WEIGHTS_NAME)
    try:
        for module, (a, b) in pairs.items():
            matrix_a, matrix_b = _read(fd, a), _read(fd, b)
            for tensor, values in ((a, matrix_a), (b, matrix_b)):
                if not np.isfinite(values).all():
                    return _rejected(
                        "non_finite", f"tensor {tensor.name!r} holds NaN or Inf", tensor=tensor.name
                    )
            peak = _largest_update(matrix_a, matrix_b, config.scale, limit)
            if peak >= limit:
                return _rejected(
                    "overflow",
                    f"{module}: the update B·A·alpha/r reaches {peak:.3g}, beyond {served.dtype}'s range "
                    f"({limit:.3g}): every request on the engine would fail",
                    module=module,
                )
    finally:
        os.close(fd)
    return AdapterVerdict("ready", rank=config.rank, modules=len(pairs))


def _model_name(name: str) -> str:
    """`meta-llama/Llama-3-8B` and `/models/Llama-3-8B/` name the same model."""
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def _pairs(tensors: list[Tensor]) -> dict[str, tuple[Tensor, Tensor]] | AdapterVerdict:
    """Each adapted module's (A, B), by the base model's module name."""
    halves: dict[str, dict[str, Tensor]] = {}
    for tensor in tensors:
        found = _PAIR.fullmatch(tensor.name)
        if found is None:
            return _rejected(
                "modules",
                f"tensor {tensor.name[:200]!r} is not a LoRA lora_A/lora_B weight (vLLM would not load it)",
            )
        if tensor.dtype not in TAKEN_DTYPES:
            return _rejected(
                "dtype",
                f"tensor {tensor.name[:200]!r} is {tensor.dtype}; the engine takes F32, F16 or BF16",
            )
        module = found["module"].removeprefix(PREFIX)
        halves.setdefault(module, {})[found["part"]] = tensor
    if not halves:
        return _rejected("modules", f"{WEIGHTS_NAME} holds no LoRA weights")
    pairs = {}
    for module, parts in halves.items():
        if set(parts) != {"A", "B"}:
            missing = "lora_B" if "A" in parts else "lora_A"
            return _rejected("modules", f"{module}: {missing} is missing")
        pairs[module] = (parts["A"], parts["B"])
    return pairs


def _shape_problem(
    module: str, a: Tensor, b: Tensor, config: Config, served: Served
) -> AdapterVerdict | None:
    base = served.weights.get(f"{module}.weight")
    if base is None:
        return _rejected("modules", f"{module} is not a module of the served model", module=module)
    if not config.targets_module(module):
        return _rejected(
            "modules", f"{module} is not one of adapter_config.json's target_modules", module=module
        )
    if len(base) != 2:
        return _rejected(
            "shapes", f"{module}: the served weight is {len(base)}-dimensional; LoRA adapts matrices"
        )
    out, inner = base
    if a.shape != (config.rank, inner) or b.shape != (out, config.rank):
        return _rejected(
            "shapes",
            f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not adapt the served "
            f"weight {list(base)} at r = {config.rank} (want {[config.rank, inner]}, {[out, config.rank]})",
            module=module,
        )
    return None


def _read(fd: int, tensor: Tensor) -> np.ndarray:
    """A tensor's values as float64 (bfloat16 widened through its bits: numpy has no bf16)."""
    raw = bytearray(tensor.nbytes)
    read_exactly(fd, memoryview(raw), tensor.start)
    if tensor.dtype == "BF16":
        widened = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        widened = np.frombuffer(raw, "<f4" if tensor.dtype == "F32" else "<f2")
    return widened.astype(np.float64).reshape(tensor.shape)


def _largest_update(a: np.ndarray, b: np.ndarray, scale: float, limit: float) -> float:
    """max |B·A| x scale: the cheap bound when it is under `limit`, else the exact value."""
    bound = float(np.abs(b).sum(axis=1).max(initial=0.0) * np.abs(a).max(initial=0.0) * abs(scale))
    if bound < limit:
        return bound
    return max((float(np.abs(block @ a).max(initial=0.0)) * abs(scale) for block in _blocks(b)), default=0.0)


def _blocks(b: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, b.shape[0], ROWS):
        yield b[start : start + ROWS]
