"""What `/server_info` says of how an engine was started, as the daemon needs it."""

from __future__ import annotations

from dataclasses import dataclass

LORA_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32"}


@dataclass(frozen=True)
class Lora:
    """`--enable-lora`: its `--max-lora-rank`, and the dtype adapters are computed in (as
    safetensors names it; None: not said)."""

    max_rank: int
    dtype: str | None


UNSAID = Lora(0, None)
"""A release whose `/server_info` has no `lora_config`: whether LoRA is on is not known."""


@dataclass(frozen=True)
class ServerConfig:
    model: str
    """The startup model path (vLLM keeps it there after reloads)."""
    sleep_mode: bool
    """`--enable-sleep-mode` (GPU/XPU only: vLLM 0.32 refuses it on CPU)."""
    extension: bool
    """Started with `--worker-extension-cls` naming `EXTENSION`."""
    revision: str | None = None
    """`--revision`: which snapshot of a hub model id (default: the cache's `main`)."""
    reload_mode: str | None = None
    """`VLLM_RELOAD_MODE` (0.34+: `layerwise` or `direct`); None where vLLM has no such setting."""
    lora: Lora | None = UNSAID
    """None: started without `--enable-lora`."""
    nnodes: int = 1
    """`--nnodes`: the nodes its ranks run on (each reads a checkpoint path on its own node)."""


def lora_of(found: object) -> Lora | None:
    """`lora_config` of `/server_info` (`()`: the key is not there)."""
    if found == ():
        return UNSAID
    if not isinstance(found, dict) or not isinstance(rank := found.get("max_lora_rank"), int):
        return None
    dtype = found.get("lora_dtype")
    return Lora(rank, LORA_DTYPES.get(dtype) if isinstance(dtype, str) else None)


def str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def nnodes_of(parallel: object) -> int:
    found = parallel.get("nnodes") if isinstance(parallel, dict) else None
    return found if type(found) is int and found > 0 else 1


def reload_mode_of(env: object) -> str | None:
    """`VLLM_RELOAD_MODE` in `/server_info`'s `vllm_env` (0.34+)."""
    return str_or_none(env.get("VLLM_RELOAD_MODE")) if isinstance(env, dict) else None
