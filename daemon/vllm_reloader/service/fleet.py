"""This host's part in a fleet, on the main loop (the records are `sources.verdicts`).

A canary host tells the fleet what it made of each content: its canary engine's reload and
canary (`judged`), and its gate's rejections, local or made while downloading (`rejected`).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..checkpoint import order
from ..sources.verdicts import Verdict
from .jobs import Job
from .outcomes import Decision

FLEET_CHECK = "canary"
"""The check a rejection taken from the canary hosts' records carries (as before downloading)."""


def judged(job: Job, decision: Decision) -> Verdict | None:
    """The canary engine's verdict on the new content it loaded; None: nothing to record (a
    reload that failed for the engine's sake, or a writer that changed the files)."""
    name, version = order.base_name(job.candidate.name), job.target.version
    fingerprint = job.loading.fingerprint if job.loading is not None else job.candidate.fingerprint
    if not fingerprint:
        return None
    if decision.result == "succeeded":
        return Verdict(name, version, fingerprint, True, canary=job.canary.enabled)
    if decision.reject is not None:  # its canary, or its reload, failed here
        return Verdict(name, version, fingerprint, False, decision.reject.reason)
    return None


def rejected(
    name: str, version: str | None, reason: str, fingerprint: str, details: Mapping[str, object]
) -> Verdict | None:
    """A rejection by this host's gate, or by the object store's listing or download digests: a
    failure for the fleet (no canary needed). Not one taken from the fleet's own records."""
    if not fingerprint or details.get("check") == FLEET_CHECK:
        return None
    base = order.base_name(name)
    return Verdict(base, version or base, fingerprint, False, reason)
