"""The probe: a forward pass on every rank, inside the pause, before any client request
reaches new weights (the worker extension's `reloader_probe`). The canary after the resume
stays as the second line: it catches what a forward pass on a few tokens cannot, wrong answers.

`judge` reads the ranks' reports; it is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import EngineCallFailed
from .client import EngineClient


@dataclass(frozen=True)
class Probe:
    """What to ask the workers: tokens to run (None: the extension draws its own, the same each
    time), and whether to scan every parameter for NaN or Inf on its device."""

    tokens: tuple[int, ...] | None = None
    scan: bool = False


@dataclass(frozen=True)
class Finding:
    broken: str | None = None
    """Why the weights must not serve (a failed load), or None."""
    unavailable: str | None = None
    """Why no rank could run a forward pass (then only the canary judges the weights)."""
    summary: dict[str, Any] = field(default_factory=dict)
    """For `reload.succeeded`: the largest |logit|, the first position's entropy, the ranks
    that computed logits, and the bytes scanned."""


def judge(results: Sequence[Any]) -> Finding:
    """Every rank must answer; one holding NaN or Inf, or whose logits are not finite or flat,
    breaks the load. Only the last pipeline stage (and, with tensor parallelism, the ranks the
    logits are gathered on) has logits: at least one rank must."""
    reports: list[dict[str, Any]] = []
    for rank, result in enumerate(results):
        if not isinstance(result, dict) or "available" not in result:
            return Finding(broken=f"rank {rank} of {len(results)} gave no probe report ({str(result)[:200]})")
        reports.append(result)
        if result.get("non_finite"):
            return Finding(broken=f"rank {rank}: parameter {result['non_finite']} holds NaN or Inf")
    for rank, report in enumerate(reports):  # every rank's logits first: one unavailable hides none
        if report.get("logits") and not report.get("finite"):
            return Finding(broken=f"rank {rank}: the logits of a forward pass are not finite")
        if report.get("logits") and report.get("flat"):
            return Finding(broken=f"rank {rank}: every token equally likely at every position")
    scanned = _scanned(reports)
    for rank, report in enumerate(reports):
        if not report["available"]:
            why = f"rank {rank}: {report.get('why') or 'no forward pass'}"
            return Finding(unavailable=why, summary=scanned)
    with_logits = [r for r in reports if r.get("logits")]
    if not with_logits:
        return Finding(unavailable="no rank computed logits", summary=scanned)
    summary: dict[str, Any] = {
        "max_abs_logit": max(float(r.get("max_abs") or 0.0) for r in with_logits),
        "entropy": with_logits[0].get("entropy"),
        "ranks_with_logits": len(with_logits),
    }
    return Finding(summary=summary | scanned)


def _scanned(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The bytes every rank scanned (only when every rank did), and the device they are on."""
    found: dict[str, Any] = {}
    if isinstance(device := reports[0].get("device") if reports else None, str):
        found["device"] = device
    if reports and isinstance(quantized := reports[0].get("quantized"), bool):
        found["quantized"] = quantized
    scanned = [r.get("scanned_bytes") for r in reports]
    if scanned and all(isinstance(n, int) for n in scanned):
        found["scanned_bytes"] = sum(n for n in scanned if isinstance(n, int))
    return found


def engine_scans(mode: str, *, able: bool, device: str | None, quantized: bool = False) -> bool:
    """Whether an engine checks its loaded parameters for NaN/Inf inside the pause (`[gate]
    scan`): only one `able` to (its extension's probe on); with `auto`, once a probe showed
    the weights on an accelerator (on a CPU engine clients would wait through a pass the
    host overlaps with the writer), unquantized (quantized ones are no longer the
    checkpoint's values)."""
    if not able or mode == "host":
        return False
    return mode in ("engine", "both") or (device not in (None, "cpu") and not quantized)


def host_scans(mode: str, engines_scan: Sequence[bool]) -> bool:
    """Whether the gate scans: asked to, or some engine would load the bytes unscanned."""
    return mode in ("host", "both") or not all(engines_scan)


PROBE_METHOD = "reloader_probe"
ADAPTER_METHOD = "reloader_probe_adapter"
OLD_EXTENSION = "the engine's worker extension predates the probe: restart the engine to load the new one"


def run(client: EngineClient, probe: Probe, timeout: float) -> Finding:
    """Ask every worker, still paused. An error answer or none within `timeout` is raised
    (`EngineError`: the caller loads the last good weights back, blaming nothing), except a
    worker without the method: an extension older than the daemon (`OLD_EXTENSION`)."""
    kwargs = {"tokens": list(probe.tokens) if probe.tokens else None, "scan": probe.scan}
    return _ask(client, PROBE_METHOD, kwargs, timeout)


def run_adapter(client: EngineClient, path: str, tokens: tuple[int, ...] | None, timeout: float) -> Finding:
    """The same pass with the adapter copy at `path` active, before clients can name it (vLLM
    loads it under an id of the probe's, and drops it after); raises as `run` does."""
    return _ask(client, ADAPTER_METHOD, {"path": path, "tokens": list(tokens) if tokens else None}, timeout)


def _ask(client: EngineClient, method: str, kwargs: dict[str, Any], timeout: float) -> Finding:
    try:
        results = client.collective_rpc(method, kwargs, timeout=timeout)
    except EngineCallFailed as exc:  # AttributeError (mp executor), NotImplementedError (uni, ray)
        said = (exc.detail or str(exc)).lower()
        if method in said and ("attribute" in said or "not implemented" in said):
            return Finding(unavailable=OLD_EXTENSION)
        raise
    return judge(results)


def tokens_of(client: EngineClient, prompts: Sequence[str]) -> tuple[int, ...] | None:
    """The canary prompts' tokens, asked before the pause (None where the engine does not say)."""
    found: list[int] = []
    for prompt in prompts:
        tokens = client.tokens(prompt)
        if tokens is None:
            return None
        found += tokens
    return tuple(found) or None
