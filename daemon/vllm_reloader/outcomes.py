"""What a reload's outcome means: success, a failed reload (restored or not), a canary
that failed (rolled back or not). Runs on the main loop, on the reloader's state."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from . import failpoints
from .engine import ReloadFailed
from .state import Loaded
from .swapper import Outcome

if TYPE_CHECKING:
    from .reloader import Reloader


def record(r: Reloader, outcome: Outcome) -> None:
    """A reload came back from the worker: record it, and what the engine now holds."""
    job, (version, path) = outcome.job, (outcome.job.target.version, outcome.job.target.path)
    if outcome.resume_error is not None:
        r.resume_owed = True
        r.log.error("engine.resume_failed", reason=str(outcome.resume_error))
    if outcome.canary_failed is not None:
        _canary_failed(r, outcome)
        return
    error = outcome.error
    r.metrics.reloads.labels(result="failed" if error else "succeeded").inc()
    if isinstance(error, ReloadFailed):
        r.log.error("reload.failed", version=version, path=path, reason=str(error), restored=error.restored)
        if error.restored and job.fallback is not None:
            r.metrics.rollbacks.labels(cause="reload").inc()
            r.log.warning(
                "reload.rolled_back", version=version, to_version=job.fallback.version, cause="reload"
            )
        if error.engine_up:
            r.reject(
                job.candidate.name,
                version,
                f"reload_weights failed: {error}",
                job.candidate.fingerprint,
                check="reload",
            )
        if not error.restored:
            r.engine_down(error)
        return
    if error is not None:
        r.log.error("reload.failed", version=version, path=path, reason=str(error), restored=False)
        r.engine_down(error)
        return
    failpoints.hit("after_version")
    loaded = Loaded(
        name=job.candidate.name, version=version, path=path, since=time.time(), step=job.candidate.step
    )
    r.set_serving(loaded, last_good=loaded)
    r.prune_cache()
    r.metrics.reload_seconds.observe(outcome.seconds)
    r.metrics.bytes_reloaded.inc(job.size)
    r.last_reload = {
        "version": version,
        "duration_ms": round(outcome.seconds * 1000, 3),
        "at": time.time(),
    }
    r.log.info(
        "reload.succeeded",
        version=version,
        path=path,
        bytes=job.size,
        duration_ms=round(outcome.seconds * 1000, 3),
        gb_per_s=round(job.size / outcome.seconds / 1e9, 3) if outcome.seconds > 0 else None,
        **(outcome.timings or {}),
    )


def _canary_failed(r: Reloader, outcome: Outcome) -> None:
    """Loaded, but the engine answered like broken weights: reject it; the worker has
    already loaded the fallback back when there was one."""
    job, reason = outcome.job, f"canary: {outcome.canary_failed}"
    r.metrics.reloads.labels(result="failed").inc()
    r.reject(job.candidate.name, job.target.version, reason, job.candidate.fingerprint, check="canary")
    if outcome.rolled_back and job.fallback is not None:
        r.metrics.rollbacks.labels(cause="canary").inc()
        r.log.warning(
            "reload.rolled_back",
            version=job.target.version,
            to_version=job.fallback.version,
            cause="canary",
            reason=reason,
            clean_after_probes=outcome.flush_probes or None,
        )
        fallback = r.state.last_good or r.state.serving
        if fallback is not None and fallback.version == job.fallback.version:
            r.set_serving(fallback)
        return
    if outcome.error is not None:  # the rollback itself failed: the engine is down or wedged
        r.log.error("reload.rollback_failed", version=job.target.version, reason=str(outcome.error))
        r.set_serving(None)
        r.engine_down(outcome.error)
        return
    # Nothing to go back to: it stays loaded, rejected, and the next good one replaces it.
    r.log.error("reload.canary_failed_no_fallback", version=job.target.version, reason=reason)
    r.set_serving(
        Loaded(name=job.candidate.name, version=job.target.version, path=job.target.path,
               since=time.time(), step=job.candidate.step)
    )  # fmt: skip
