"""The gate for a LoRA adapter (PEFT's files): whether it may load into the model served.

vLLM checks little when it loads an adapter at run time, and a loaded adapter takes part in
every request on the engine: one of NaN weights made every base-model request fail; one
finite on disk whose update overflows (`lora_B` holding ±3e38) made every request fail,
the other adapters' included (vLLM 0.32, CPU). So nothing loads on a guess:

- `adapter_config.json` read within bounds (size, nesting) and checked as vLLM's
  `PEFTHelper` would take it (LoRA only; no DoRA, bias or `modules_to_save`; `lora_alpha`
  given): `r` (per module with `rank_pattern`) at most the engine's `--max-lora-rank`;
  `base_model_name_or_path` not positively another model (`other_model`: names are not
  compared; where both are local directories, their config.json's architecture and sizes). A
  `target_modules` list must name the adapted modules (a regex is the writer's own: an
  adapter's pattern is never run here).
- `adapter_model.safetensors` whole (its header accounts for the file, as safetensors
  checks): every tensor one `lora_A` or `lora_B` of a module of the served model, once,
  `A` of (r, in) and `B` of (out, r) for a base weight of (out, in), in F32, F16 or BF16.
- Every value finite, and within the serving dtype's range the way vLLM computes with it:
  `A`, and `B` times the module's scale (`alpha/r`, `alpha/√r` with rsLoRA, `alpha_pattern`
  per module), each converted to that dtype; and the update `B·A·scale` bounded by the max
  row sum of |B·scale| times the max |A|. Cancelling factors get no credit: vLLM never forms
  `B·A`, it computes `(x·Aᵀ)·Bᵀ`, where large factors overflow whatever their product.

A verdict is data, as the checkpoint gate's: `ready` (with the files' identities, compared
again before the load), `pending` (a file missing or short: still being written) or
`rejected` with the check that failed.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

import numpy as np

from ..errors import LayoutUnreadable
from .base_model import other_model
from .files import (
    Header,
    Identity,
    Tensor,
    identity,
    layout_problem,
    open_regular,
    parse_json,
    read_exactly,
    read_header,
    read_small_at,
    reader,
)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
TAKEN_DTYPES = frozenset({"F32", "F16", "BF16"})
"""What vLLM's LoRA loader takes (it converts to the LoRA dtype)."""
DTYPE_MAX = {"F32": float(np.finfo(np.float32).max), "BF16": 3.3895e38, "F16": 65504.0}
PREFIX = "base_model.model."
_PAIR = re.compile(r"(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
_LITERAL = re.compile(r"[\w.]+")
"""A `rank_pattern`/`alpha_pattern` key taken here: a module name or suffix (no regex)."""
UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save",
    "layer_replication": "layer_replication",
    "lora_bias": "lora_bias",
}
"""Config keys vLLM's LoRA loader refuses when set (truthy)."""


@dataclass(frozen=True)
class Served:
    """What the engine serves, as an adapter is compared with it."""

    weights: Mapping[str, tuple[int, ...]]
    """The base model's weight shapes by tensor name (its checkpoint's headers)."""
    dtype: str = "BF16"
    """The serving dtype (`DTYPE_MAX`): a value or update beyond its range overflows."""
    max_rank: int = 16
    model: str | None = None
    """The base model's name or path, as an adapter's config would name it (None: not compared)."""


@dataclass(frozen=True)
class AdapterVersion:
    """One verified version of an adapter: the copy the engine reads, as the gate saw it."""

    adapter: str
    version: str
    path: str
    fingerprint: str
    files: Mapping[str, Identity] = field(default_factory=dict)
    size: int = 0


@dataclass(frozen=True)
class AdapterVerdict:
    status: str
    reason: str = ""
    check: str = ""
    """For `rejected`: which check failed (`config`, `rank`, `modules`, `shapes`, `dtype`,
    `base_model`, `non_finite`, `overflow`, `io`)."""
    rank: int = 0
    modules: int = 0
    files: Mapping[str, Identity] = field(default_factory=dict)
    """`ready`: the identities of the two files as verified (`files.changed` before the load)."""
    details: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    rank: int
    alpha: float
    targets: tuple[str, ...] | None
    """Module names or suffixes; None: a regex (the writer's own, never run here)."""
    rslora: bool
    base_model: str | None
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)

    def rank_of(self, module: str) -> int:
        return int(_by_pattern(self.rank_pattern, module, self.rank))

    def scale_of(self, module: str) -> float:
        rank, alpha = self.rank_of(module), _by_pattern(self.alpha_pattern, module, self.alpha)
        return alpha / (math.sqrt(rank) if self.rslora else rank)

    def targets_module(self, module: str) -> bool:
        return self.targets is None or any(_names(t, module) for t in self.targets)


def _names(pattern: str, module: str) -> bool:
    return module == pattern or module.endswith("." + pattern)


def _by_pattern(patterns: Mapping[str, float], module: str, default: float) -> float:
    """PEFT's rule for `rank_pattern`/`alpha_pattern`: the first key naming the module."""
    return next((value for key, value in patterns.items() if _names(key, module)), default)


def _rejected(check: str, reason: str, **details: object) -> AdapterVerdict:
    return AdapterVerdict("rejected", reason, check, details=dict(details))


def _number(value: object) -> TypeGuard[float]:
    """A JSON number a float holds (an integer of 400 digits is not: no OverflowError later)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) < 1 << 1000
    return isinstance(value, float) and math.isfinite(value)


def _integer(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _patterns(found: dict[str, object], key: str, *, integer: bool) -> dict[str, float]:
    patterns = found.get(key) or {}
    if not isinstance(patterns, dict):
        raise ValueError(f"{CONFIG_NAME}: {key} must be an object")
    for name, value in patterns.items():
        if not _LITERAL.fullmatch(name):
            raise ValueError(
                f"{CONFIG_NAME}: {key} key {name[:80]!r} is a regex; only module names are taken"
            )
        if not (_integer(value) if integer else _number(value)) or value <= 0:
            raise ValueError(f"{CONFIG_NAME}: {key}[{name[:80]!r}] must be a positive number")
    return dict(patterns)


def parse_config(data: bytes) -> Config:
    """Raises `json.JSONDecodeError` (not JSON) or `ValueError` (one line: what is wrong)."""
    found = parse_json(data)
    if not isinstance(found, dict):
        raise ValueError(f"{CONFIG_NAME} is not a JSON object")
    peft_type = found.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{CONFIG_NAME}: peft_type {str(peft_type)[:40]!r}, not LORA")
    rank, alpha = found.get("r"), found.get("lora_alpha")
    if not _integer(rank) or not 0 < rank <= 1 << 16:
        raise ValueError(f"{CONFIG_NAME}: r must be a positive integer, not {str(rank)[:40]}")
    if not _number(alpha):
        raise ValueError(f"{CONFIG_NAME}: lora_alpha must be a finite number, not {str(alpha)[:40]}")
    if (bias := found.get("bias", "none")) not in ("none", None):
        raise ValueError(f"{CONFIG_NAME}: bias {str(bias)[:40]!r}: vLLM loads LoRA without biases only")
    if refused := next((what for key, what in UNSUPPORTED.items() if found.get(key)), None):
        raise ValueError(f"{CONFIG_NAME}: {refused} is set, which vLLM's LoRA loader refuses")
    if not isinstance(rslora := found.get("use_rslora", False), bool):
        raise ValueError(f"{CONFIG_NAME}: use_rslora must be true or false")
    targets = found.get("target_modules")
    if isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        chosen: tuple[str, ...] | None = tuple(targets)
    elif isinstance(targets, str) and targets:
        chosen = None
    else:
        raise ValueError(f"{CONFIG_NAME}: target_modules must be a list of module names or a regex")
    base = found.get("base_model_name_or_path")
    return Config(
        rank, float(alpha), chosen, rslora, base if isinstance(base, str) else None,
        {k: int(v) for k, v in _patterns(found, "rank_pattern", integer=True).items()},
        _patterns(found, "alpha_pattern", integer=False),
    )  # fmt: skip


def check(
    directory: Path, served: Served, *, now: float | None = None, grace: float = 10.0
) -> AdapterVerdict:
    """Judge one adapter version's directory against what the engine serves. A config or
    weights header that is not whole may still be written for `grace` seconds after it
    last changed. Nothing escapes: any other surprise rejects this version."""
    try:
        return _check(directory, served, time.time() if now is None else now, grace)
    except FileNotFoundError as exc:
        return AdapterVerdict("pending", f"{Path(exc.filename or directory).name} is not there yet")
    except LayoutUnreadable as exc:
        return _rejected("shapes", str(exc)[:500])
    except OSError as exc:
        where = Path(exc.filename).name if exc.filename else WEIGHTS_NAME
        return _rejected("io", f"cannot read {where}: {exc.strerror or exc}")
    except (ValueError, ArithmeticError, MemoryError, RecursionError) as exc:  # this version only
        return _rejected("internal", f"{type(exc).__name__}: {exc}"[:500])


def _check(directory: Path, served: Served, now: float, grace: float) -> AdapterVerdict:
    path = directory / CONFIG_NAME
    config_fd = open_regular(path)  # its identity and its bytes from one open
    try:
        config_identity = identity(os.fstat(config_fd))
        data = read_small_at(config_fd, path, MAX_CONFIG_BYTES)
    finally:
        os.close(config_fd)
    try:
        config = parse_config(data)
    except json.JSONDecodeError as exc:
        if 0 <= now - config_identity[3] / 1e9 < grace:  # a time ahead of the clock: no grace
            return AdapterVerdict("pending", f"{CONFIG_NAME} is not whole JSON yet (may still be written)")
        return _rejected("config", f"{CONFIG_NAME} is not JSON: {exc}")
    except ValueError as exc:
        return _rejected("config", str(exc))
    ranks = [config.rank, *config.rank_pattern.values()]
    if max(ranks) > served.max_rank:
        return _rejected(
            "rank", f"r = {max(ranks)} is over the engine's max LoRA rank {served.max_rank} (--max-lora-rank)"
        )
    if served.model and config.base_model and (other := other_model(config.base_model, served.model)):
        return _rejected("base_model", other)
    fd = open_regular(directory / WEIGHTS_NAME)
    try:
        found = identity(os.fstat(fd))
        header = read_header(WEIGHTS_NAME, reader(fd), found[2], max_tensors=4 * len(served.weights) + 16)
        if header is None or found[2] < header.whole_size:
            if 0 <= now - found[3] / 1e9 < grace:
                return AdapterVerdict(
                    "pending", f"{WEIGHTS_NAME} is shorter than its header says (still being written)"
                )
            return _rejected("shapes", f"{WEIGHTS_NAME} is shorter than its safetensors header says")
        if problem := layout_problem(WEIGHTS_NAME, header, found[2]):
            return _rejected("shapes", problem)
        verdict = _weights(fd, header, config, served)
    finally:
        os.close(fd)
    if verdict.status != "ready":
        return verdict
    files = {CONFIG_NAME: config_identity, WEIGHTS_NAME: found}
    return AdapterVerdict("ready", rank=max(ranks), modules=verdict.modules, files=files)


def _weights(fd: int, header: Header, config: Config, served: Served) -> AdapterVerdict:
    pairs = _pairs(header.tensors)
    if isinstance(pairs, AdapterVerdict):
        return pairs
    for module, (a, b) in pairs.items():
        if problem := _shape_problem(module, a, b, config, served):
            return problem
    limit = DTYPE_MAX.get(served.dtype, DTYPE_MAX["F16"])
    for module, (a, b) in pairs.items():
        magnitude_a, magnitude_b = np.abs(_read(fd, a)), np.abs(_read(fd, b))  # one pass each
        largest_a, largest_b = float(magnitude_a.max(initial=0.0)), float(magnitude_b.max(initial=0.0))
        for tensor, largest in ((a, largest_a), (b, largest_b)):
            if not math.isfinite(largest):  # max carries NaN and Inf through
                return _rejected("non_finite", f"tensor {tensor.name!r} holds NaN or Inf", tensor=tensor.name)
        scale = abs(config.scale_of(module))
        bound = float(magnitude_b.sum(axis=1, dtype=np.float64).max(initial=0.0)) * scale * largest_a
        for what, peak in (
            ("lora_A", largest_a),
            ("lora_B x scale", largest_b * scale),
            ("the update B·A·scale", bound),
        ):
            if peak >= limit:
                return _rejected(
                    "overflow",
                    f"{module}: {what} reaches {peak:.3g}, beyond {served.dtype}'s range ({limit:.3g}): "
                    "every request on the engine would fail",
                    module=module,
                )
    return AdapterVerdict("ready", modules=len(pairs))


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
                "dtype", f"tensor {tensor.name[:200]!r} is {tensor.dtype}; the engine takes F32, F16 or BF16"
            )
        module, part = found["module"].removeprefix(PREFIX), found["part"]
        if part in halves.setdefault(module, {}):  # vLLM would load one, the gate check the other
            return _rejected("modules", f"{module}: lora_{part} is there twice (with and without {PREFIX!r})")
        halves[module][part] = tensor
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
    rank = config.rank_of(module)
    if a.shape != (rank, inner) or b.shape != (out, rank):
        return _rejected(
            "shapes",
            f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not adapt the served "
            f"weight {list(base)} at r = {rank} (want {[rank, inner]}, {[out, rank]})",
            module=module,
        )
    return None


def _read(fd: int, tensor: Tensor) -> np.ndarray:
    """A tensor's values as float32, which holds each of F32, F16 and BF16 exactly (bfloat16
    widened through its bits: numpy has no bf16). Its size was checked against its shape
    (`layout_problem`) and the served weight's."""
    raw = bytearray(tensor.nbytes)
    read_exactly(fd, memoryview(raw), tensor.start)
    if tensor.dtype == "BF16":
        widened = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    elif tensor.dtype == "F16":
        widened = np.frombuffer(raw, "<f2").astype(np.float32)
    else:
        widened = np.frombuffer(raw, "<f4")
    return widened.reshape(tensor.shape)
