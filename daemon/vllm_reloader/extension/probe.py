"""A forward pass inside the pause: do the new weights compute at all, before any client
request reaches them?

vLLM's model runner already runs the model with no request involved (`_dummy_run`, its
warm-up): no attention metadata, so no KV-cache block is written, and no sampler or scheduler
state is touched. This runs it on a few tokens and checks the logits on every rank that has
them (the last pipeline stage), and, with `scan`, every parameter for NaN or Inf on the device
that holds it (a GPU reads its memory far faster than the host reads the files).

With no metadata an attention backend computes nothing: some leave its output as allocated
(CPU's: whatever the memory held, NaN at times), so each attention layer answers as if each
token attended to itself alone (`_quiet_attention`): its value, with its query-key score
folded in so a NaN or Inf there shows. The q/k/v and output projections (and LoRA adapters on
them), embeddings, norms, MLPs and the output layer are what it judges; `scan` reads the rest.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

_STATEFUL = re.compile(r"Mamba|LinearAttention|ShortConv|GatedDeltaNet|Lightning")
"""Layers that, given no attention metadata (a warm-up), return memory as allocated: a pass
through them would judge whatever that memory held."""
FLAT = 1e-6
"""Logits closer than this across the vocabulary at a position count as equal."""
SCAN_CHUNK = 1 << 24
"""Elements checked at once: a bounded temporary, whatever the size of a parameter."""
RANDOM_TOKENS = 16
"""Tokens probed when the daemon sends none (a fixed seed: the same tokens every time)."""
PROBE_LORA_ID = 2**31 - 7
"""The adapter probe's own LoRA id: vLLM's API server numbers adapters from 1 upwards."""
PROBE_LORA_NAME = "vllm-reloader-probe"


def probe(worker: Any, tokens: list[int] | None, scan: bool) -> dict[str, Any]:
    """What a forward pass on this rank gave: `available` False (with `why`) where this vLLM
    cannot run one without side effects; else `logits` (this rank computes them), `finite`,
    `flat`, `max_abs`, `entropy` (of the first position's distribution, in nats), and with
    `scan` the first parameter holding NaN or Inf (`non_finite`) and `scanned_bytes`, all
    within `ms`; `device` is the parameters' (`cuda`, `cpu`, ...)."""
    started = time.perf_counter()
    runner = worker.model_runner
    report: dict[str, Any] = {"rank": getattr(worker, "rank", None), "available": True}
    model = runner.get_model()
    report["device"] = next((p.device.type for p in model.parameters()), None)
    # Quantized weights are no longer the checkpoint's values: a scan of them misses some NaN.
    report["quantized"] = bool(getattr(getattr(runner, "model_config", None), "quantization", None))
    with torch.inference_mode():
        if scan:
            report["non_finite"], report["scanned_bytes"] = _scan(model)
        why = _unavailable(runner)
        if why is not None:
            report.update(available=False, why=why)
        else:
            try:
                report.update(_forward(runner, model, tokens))
            except Exception as exc:  # vLLM's machinery, not the weights: non-finite values raise nothing
                why = f"the forward pass raised {type(exc).__name__}: {exc}"
                report.update(available=False, why=why[:300])
    report["ms"] = round((time.perf_counter() - started) * 1000, 3)
    return report


def _unavailable(runner: Any) -> str | None:
    if not callable(getattr(runner, "_dummy_run", None)) or not _proven(type(runner)):
        return f"this vLLM's model runner ({type(runner).__name__}) has no GPUModelRunner._dummy_run"
    parallel = getattr(runner, "parallel_config", None)
    if getattr(parallel, "data_parallel_size", 1) > 1:
        return "data parallel: a dummy pass on one engine would wait for the others"
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        return "pipeline parallel: a dummy pass gives each later stage stale inputs, not the stage before's"
    stateful = {type(m).__name__ for m in runner.get_model().modules() if _STATEFUL.search(type(m).__name__)}
    if stateful:
        return (
            f"a hybrid model ({', '.join(sorted(stateful))}): its state layers leave their output undefined"
        )
    if getattr(runner, "lora_config", None) is not None and not callable(
        getattr(runner, "_set_active_loras", None)
    ):
        return "LoRA is enabled and this vLLM's runner has no _set_active_loras to map the pass's tokens"
    model_config = getattr(runner, "model_config", None)
    if getattr(model_config, "enable_prompt_embeds", False) or getattr(runner, "supports_mm_inputs", False):
        return "the model takes embeddings or multimodal inputs: no token ids to probe with"
    return None


def _proven(runner: type) -> bool:
    """The pass this probe was proven on: `GPUModelRunner._dummy_run` (vLLM 0.27-0.33; CPU's
    runner inherits it). 0.34's rewritten runners have passes of their own, not yet proven."""
    return any(
        cls.__name__ == "GPUModelRunner"
        and cls.__module__ == "vllm.v1.worker.gpu_model_runner"
        and "_dummy_run" in vars(cls)
        for cls in runner.__mro__
    )


def _scan(model: torch.nn.Module) -> tuple[str | None, int]:
    """The first float parameter or buffer holding NaN or Inf, and the bytes read."""
    scanned = 0
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in tensors:
        if not tensor.dtype.is_floating_point:
            continue
        for piece in _pieces(tensor.detach()):
            if tensor.element_size() == 1:  # fp8: torch has no isfinite for float8_e4m3fn
                piece = piece.float()
            if not bool(torch.isfinite(piece).all()):
                return name, scanned
        scanned += tensor.numel() * tensor.element_size()
    return None, scanned


def _pieces(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """`SCAN_CHUNK` elements or so at a time, never a copy of the whole (a transposed weight,
    as fp8 layers keep theirs, is cut along its first dimension instead of flattened)."""
    if tensor.dim() == 0 or tensor.is_contiguous():
        yield from torch.split(tensor.reshape(-1), SCAN_CHUNK)
        return
    rows = max(1, SCAN_CHUNK // max(1, tensor[0].numel()))
    yield from torch.split(tensor, rows)


def probe_adapter(worker: Any, path: str, tokens: list[int] | None) -> dict[str, Any]:
    """The same forward pass with the adapter at `path` active, loaded by vLLM's own LoRA loader
    under an id of the probe's (`PROBE_LORA_ID`) and removed after: it is judged before clients
    can name it. `available` False where no adapter pass can run (then the canary judges it)."""
    started = time.perf_counter()
    runner = worker.model_runner
    report: dict[str, Any] = {"rank": getattr(worker, "rank", None), "available": True}
    # The running vLLM's own class (loaded with it: read, not imported).
    request_class: Any = getattr(sys.modules.get("vllm.lora.request"), "LoRARequest", None)
    why = _unavailable(runner) or _no_adapter_pass(runner, request_class)
    if why is not None:
        return report | {"available": False, "why": why, "ms": _ms(started)}
    request = request_class(lora_name=PROBE_LORA_NAME, lora_int_id=PROBE_LORA_ID, lora_path=path)
    with torch.inference_mode():
        try:
            loaded = _loaded(runner, request)
            if not _everywhere(loaded is None):  # a rank that could not load it: none runs the pass
                why = loaded or "another rank could not load it"
                return report | {"available": False, "why": why, "ms": _ms(started)}
            report.update(_forward(runner, runner.get_model(), tokens, request))
        except Exception as exc:
            report.update(available=False, why=f"the forward pass raised {type(exc).__name__}: {exc}"[:300])
        finally:
            runner.remove_lora(PROBE_LORA_ID)  # also after a load that failed half-way
    return report | {"ms": _ms(started)}


def _no_adapter_pass(runner: Any, request_class: Any) -> str | None:
    """Where no adapter pass can run. With vLLM's adapter cache full the probe's copy takes the
    place of the least recently used adapter, as any request for another adapter does (it is
    read again from its path when next asked for): `--max-cpu-loras` above `--max-loras` spares it."""
    if getattr(runner, "lora_config", None) is None or request_class is None:
        return "LoRA is not enabled on this engine's runner"
    return None


def _loaded(runner: Any, request: Any) -> str | None:
    """Loaded (None), or why vLLM refused it (then so would the load clients' requests need)."""
    runner.remove_lora(PROBE_LORA_ID)  # a copy left by a probe that died half-way: never reused
    try:
        runner.add_lora(request)
    except Exception as exc:
        return f"vLLM did not load it: {exc}"[:300]
    return None


def _everywhere(ok: bool) -> bool:
    """Whether every tensor-parallel rank says `ok` (one that goes on into the pass alone would
    wait for the others' collectives forever); this rank's own where there is one rank."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    group = state.get_tp_group() if state is not None and hasattr(state, "get_tp_group") else None
    if group is None or getattr(group, "world_size", 1) <= 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
    return bool(flag.item())


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)


@contextmanager
def _lora_mapping(runner: Any, request: Any) -> Iterator[None]:
    """With LoRA enabled, vLLM's dummy pass registers warm-up adapters under ids 1.. (those of
    the adapters clients use) and removes every adapter after: instead, map the pass's tokens
    to `request` (None: to no adapter) and leave the adapters alone (an instance attribute over
    the runner's method, removed after; the next step maps its own batch)."""
    if getattr(runner, "lora_config", None) is None:
        yield
        return

    def mapped(_config: Any, scheduled: Any, sampled: Any = None, *_: Any, **__: Any) -> Any:
        lora_id = request.lora_int_id if request is not None else 0
        tokens, samples = int(scheduled.sum()), int(sampled.sum()) if sampled is not None else len(scheduled)
        runner._set_active_loras(
            (lora_id,) * samples, (lora_id,) * tokens, {request} if request is not None else set()
        )
        return nullcontext()

    runner.maybe_dummy_run_with_lora = mapped
    try:
        yield
    finally:
        vars(runner).pop("maybe_dummy_run_with_lora", None)


def _forward(runner: Any, model: Any, tokens: list[int] | None, lora: Any = None) -> dict[str, Any]:
    vocab = int(runner.model_config.get_vocab_size())
    ids = [t for t in tokens or () if 0 <= t < vocab][: _room(runner)]
    if not ids:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (min(RANDOM_TOKENS, _room(runner)),), generator=generator).tolist()
    buffer = runner.input_ids
    buffer = getattr(buffer, "gpu", buffer)  # a CpuGpuBuffer, or the tensor itself
    buffer[: len(ids)].copy_(torch.tensor(ids, dtype=buffer.dtype))
    known = inspect.signature(runner._dummy_run).parameters
    # Eager, every token real (not padding: MoE routers skip padding), no EPLB step.
    wanted = {"is_profile": True, "skip_eplb": True, "remove_lora": True}
    kwargs = {k: v for k, v in wanted.items() if k in known}
    with _quiet_attention(model) as quieted, _lora_mapping(runner, lora):
        if not quieted:
            return {"available": False, "why": "no attention layer found whose output the pass can set"}
        out = runner._dummy_run(len(ids), **kwargs)
    hidden = out[0] if isinstance(out, tuple) else out
    if not isinstance(hidden, torch.Tensor):  # pipeline parallel, not the last stage
        return {"logits": False, "tokens": len(ids)}
    found = _logits(model, hidden[: len(ids)])
    if found is None:  # tensor parallel, logits gathered on another rank
        return {"logits": False, "tokens": len(ids)}
    logits = found.float()
    finite = bool(torch.isfinite(logits).all())
    spread = logits.amax(dim=-1) - logits.amin(dim=-1)
    first = torch.log_softmax(logits[0], dim=-1)
    entropy = float(-(first.exp() * first).nansum())
    max_abs = float(logits.abs().nan_to_num(nan=math.inf, posinf=math.inf).max())  # default posinf: FLT_MAX
    return {
        "logits": True,
        "tokens": len(ids),
        "finite": finite,
        "flat": finite and bool((spread < FLAT).all()),
        "max_abs": max_abs if math.isfinite(max_abs) else None,
        "entropy": round(entropy, 4) if math.isfinite(entropy) else None,
    }


@contextmanager
def _quiet_attention(model: torch.nn.Module) -> Iterator[int]:
    """Every attention layer's backend answers `_self_only`, touching no KV cache, while in it
    (an instance attribute over the class's `forward`, removed after); yields how many."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    impls: list[Any] = [getattr(m, "impl", None) for m in layers]
    impls = [i for i in impls if callable(getattr(i, "forward", None)) and "forward" not in vars(i)]
    try:
        for impl in impls:
            impl.forward = _self_only
        yield len(impls)
    finally:
        for impl in impls:
            vars(impl).pop("forward", None)


def _self_only(
    layer: Any,
    query: torch.Tensor,
    key: Any = None,
    value: Any = None,
    *_: Any,
    output: Any = None,
    **kw: Any,
) -> Any:
    """Attention where each token sees only itself (a softmax over one score is 1): the output
    is the token's value, repeated for each query head of its group, times (1 + 0 * its score
    q·k), so weights that overflow q, k or v reach the logits as NaN or Inf. What it cannot
    read (MLA's latent inputs, a quantized query or output, an output with scales) answers
    zeros."""
    found = None
    floats = (torch.float16, torch.bfloat16, torch.float32)
    quantized = kw.get("output_scale") is not None or kw.get("output_block_scale") is not None
    if not quantized and query.dtype in floats and (output is None or output.dtype in floats):
        try:
            found = _own_values(layer, query, key, value)
        except (RuntimeError, ValueError, TypeError, AttributeError):
            found = None
    if found is None:
        return output.zero_() if output is not None else torch.zeros_like(query)
    if output is not None:
        return output.copy_(found.reshape(output.shape))
    return found.reshape(query.shape).to(query.dtype)


def _own_values(layer: Any, query: torch.Tensor, key: Any, value: Any) -> torch.Tensor | None:
    if not (isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)) or value.shape != key.shape:
        return None
    tokens = query.shape[0]
    heads = query.shape[1] if query.dim() == 3 else int(layer.num_heads)
    kv_heads = key.shape[1] if key.dim() == 3 else int(getattr(layer, "num_kv_heads", heads))
    q, k, v = (
        t.reshape(tokens, n, -1).float() for t, n in ((query, heads), (key, kv_heads), (value, kv_heads))
    )
    if q.shape[-1] != k.shape[-1] or heads % kv_heads:
        return None
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    score = (q * k).sum(dim=-1, keepdim=True)
    return v * (1 + 0 * score)


def _room(runner: Any) -> int:
    return max(1, min(int(getattr(runner, "max_num_tokens", RANDOM_TOKENS)), 64))


def _logits(model: Any, hidden: torch.Tensor) -> torch.Tensor | None:
    """`compute_logits(hidden)` (vLLM 0.11+; older ones also took sampling metadata); None
    on a rank the logits are not gathered on."""
    takes = len(inspect.signature(model.compute_logits).parameters)
    found = model.compute_logits(hidden) if takes == 1 else model.compute_logits(hidden, None)
    return found if isinstance(found, torch.Tensor) else None
