"""What the daemon tells its operators: the control socket's `status` answer, the one line
systemd shows (`STATUS=`), and the on-call view `vllm-reloader status` prints. All three
render a `Snapshot`: immutable, taken on the main loop from the state's owners, so nothing
here reads live state (and nothing here knows the daemon)."""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.nodes import NodeState
from .catalog import Catalog
from .gating import Gating
from .jobs import Job
from .served import Served
from .state import Loaded, Rejection


@dataclass(frozen=True)
class EngineView:
    """One engine of the host, as `status` lists it."""

    url: str
    version: str | None
    state: str
    """serving, reloading, unreachable or behind (`rollout.state`)."""
    reachable: bool
    last_reload: Mapping[str, Any] | None = None
    last_error: str | None = None
    """What fails here now: why the engine did not answer (while not `reachable`), else why the
    last reload here failed; it is tried again in `retry_in_s`."""
    retry_in_s: float | None = None
    fingerprint: str | None = None
    """Which content of `version` it holds (two may share a version name)."""
    newer: tuple[str, ...] = ()
    """Candidates newer than what it serves, not rejected (pending ones included): what it has
    yet to serve (the metrics time how long it has been behind)."""
    nodes: tuple[dict[str, Any], ...] = ()
    """A multi-node engine: each node's staging state, as its ranks last said (`node_views`)."""

    def answer(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "state": self.state,
            "reachable": self.reachable,
            "last_reload": dict(self.last_reload) if self.last_reload else None,
            "last_error": self.last_error,
            "retry_in_s": self.retry_in_s,
            **({"nodes": list(self.nodes)} if self.nodes else {}),
        }


def node_views(version: str, states: Sequence[NodeState]) -> tuple[dict[str, Any], ...]:
    return tuple(
        {"node": s.node, "ranks": list(s.ranks), "version": version, "problem": s.problem} for s in states
    )


@dataclass(frozen=True)
class Snapshot:
    serving: Loaded | None
    last_good: Loaded | None
    rollback: str | None
    """The version a failed reload would go back to; None: nothing intact is left."""
    last_reload: Mapping[str, Any] | None
    reloading: str | None
    gating: Mapping[str, object] | None
    """The candidate being judged: name, bytes read (`done`) of `total`."""
    pinned: str | None
    pending: Mapping[str, str]
    rejected: Mapping[str, Rejection]
    engines: tuple[EngineView, ...]
    """Every engine, the canary engine first."""
    last_scan: float
    source_url: str | None = None
    """An object-store source; then `source_failing` says what fails now."""
    source_failing: Mapping[str, str] = field(default_factory=dict)
    pinned_rejected: str | None = None
    """Why the pinned content was rejected: it is not loaded while the pin holds."""
    passed_over: Mapping[str, str] = field(default_factory=dict)
    """Copied in while running, never loaded by itself (older than what serves): why, and the fix."""
    adapters: Mapping[str, Any] = field(default_factory=dict)
    """LoRA adapters by name (`service.adapters`)."""


def snapshot_of(
    served: Served,
    catalog: Catalog,
    in_flight: Job | None,
    gating: Gating | None,
    engines: tuple[EngineView, ...],
) -> Snapshot:
    """Taken on the main loop, from the objects that own the state."""
    return Snapshot(
        serving=served.serving,
        last_good=served.last_good,
        rollback=served.rollback,
        last_reload=dict(served.last_reload) if served.last_reload else None,
        reloading=in_flight.target.version if in_flight else None,
        gating=None
        if gating is None
        else {"name": gating.candidate.name, "done": gating.progress.done, "total": gating.progress.total},
        pinned=catalog.pinned,
        pending=dict(sorted(catalog.pending.items())),
        rejected=dict(sorted(catalog.rejected.items())),
        engines=engines,
        last_scan=catalog.last_scan,
        pinned_rejected=catalog.rejection_of(catalog.pinned) if catalog.pinned else None,
        passed_over=dict(sorted(catalog.passed_over.items())),
    )


def _escape(char: str) -> str:
    if unicodedata.category(char)[0] != "C":
        return char
    if 0xDC80 <= ord(char) <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{ord(char) - 0xDC00:02x}"
    return char.encode("unicode_escape").decode()


def printable(text: object) -> str:
    """`text` with every control, format or surrogate character escaped: names and versions
    come from writers, and a newline in systemd's STATUS= starts a new field
    (`WATCHDOG=trigger`), one in the on-call view a fake line."""
    return "".join(map(_escape, str(text)))


def answer(snapshot: Snapshot) -> dict[str, Any]:
    first = snapshot.engines[0].answer()
    found: dict[str, Any] = {
        "serving": snapshot.serving.model_dump() if snapshot.serving else None,
        "last_good": snapshot.last_good.model_dump() if snapshot.last_good else None,
        "rollback": snapshot.rollback,
        "last_reload": dict(snapshot.last_reload) if snapshot.last_reload else None,
        "reloading": snapshot.reloading,
        "gating": dict(snapshot.gating) if snapshot.gating else None,
        "pinned": snapshot.pinned,
        "pinned_rejected": snapshot.pinned_rejected,
        "pending": dict(snapshot.pending),
        "rejected": {name: r.model_dump() for name, r in snapshot.rejected.items()},
        "passed_over": dict(snapshot.passed_over),
        "engine": {key: first[key] for key in ("url", "reachable", "last_error", "retry_in_s")},
        "engines": [engine.answer() for engine in snapshot.engines],
    }
    if snapshot.adapters:
        found["adapters"] = dict(snapshot.adapters)
    if snapshot.source_url is not None:
        found["source"] = {"url": snapshot.source_url, "failing": dict(snapshot.source_failing)}
    return found


def line(snapshot: Snapshot) -> str:
    """One line for systemd's STATUS=: what is served, since when, what waits, and whether a
    failed reload has anything to go back to. It changes only when one of those does."""
    serving = snapshot.serving
    parts = [
        f"serving {serving.version} since {time.strftime('%H:%M:%S', time.localtime(serving.since))}"
        if serving
        else "waiting for the engine"
    ]
    if snapshot.reloading is not None:
        parts.append(f"reloading {snapshot.reloading}")
    if len(snapshot.engines) > 1:
        serving_count = sum(e.state == "serving" for e in snapshot.engines)
        parts.append(f"{serving_count}/{len(snapshot.engines)} engines serving")
    parts.append(f"{len(snapshot.pending)} pending")
    if snapshot.last_scan:
        # A time, not an age: the line (one datagram each time it changes) stays still between scans.
        parts.append(f"last scan {time.strftime('%H:%M:%S', time.localtime(snapshot.last_scan))}")
    if snapshot.source_failing:
        parts.append("object store failing")
    if snapshot.serving is not None and snapshot.rollback is None:
        parts.append("NO ROLLBACK TARGET")
    return printable("; ".join(parts))


def _ago(timestamp: float) -> str:
    seconds = max(0, int(time.time() - timestamp))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _engine_line(engine: dict[str, Any]) -> str:
    content = f" ({engine['fingerprint'][:16]})" if engine.get("fingerprint") else ""
    line = f"  {engine['url']}  {engine['version']}{content}  {engine['state']}"
    if last := engine.get("last_reload"):
        line += f"  last {last['version']}{_rolled_back(last)} {_ago(last['at'])} ago"
    if engine.get("last_error"):
        line += f"  FAILED: {engine['last_error']}{_retry(engine)}"
    return line


def _node_line(node: dict[str, Any]) -> str:
    """One node of a multi-node engine, as its ranks said before the last reload of `version`."""
    found = f"NOT STAGED: {node['problem']}" if node.get("problem") else "staged and verified"
    return f"node      {node['node']}  {node['version']}: {found}"


def _rolled_back(last: dict[str, Any]) -> str:
    to = last.get("rolled_back_to")
    return f" ROLLED BACK to {to} ({last.get('cause')})" if to else ""


def _retry(engine: dict[str, Any]) -> str:
    return "" if engine.get("retry_in_s") is None else f" (retry in {engine['retry_in_s']:.0f} s)"


def _pinned(answer: dict[str, Any]) -> str:
    if rejected := answer.get("pinned_rejected"):
        return (
            f"pinned    {answer['pinned']}  REJECTED: {rejected}; not loaded "
            "(`vllm-reloader unpin` resumes, `pin --force` tries it again)"
        )
    return f"pinned    {answer['pinned']}  (not auto-advancing; `vllm-reloader unpin` resumes)"


def _content(rejection: dict[str, Any]) -> str:
    """Which content of the name was rejected: another one under the same name is tried."""
    return f" ({rejection['fingerprint'][:16]})" if rejection.get("fingerprint") else ""


def render(answer: dict[str, Any]) -> str:
    """The on-call view: one fact per line, reasons in full."""
    serving = answer.get("serving")
    lines = []
    if serving:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(serving["since"]))
        lines.append(f"serving   {serving['version']}  since {since} ({_ago(serving['since'])} ago)")
        lines.append(f"          {serving['path']}")
        if serving.get("fingerprint"):
            lines.append(f"          fingerprint {serving['fingerprint']}")
    else:
        lines.append("serving   (unknown: waiting for the engine)")
    engine = answer.get("engine", {})
    reachable = "reachable" if engine.get("reachable") else "UNREACHABLE"
    if not engine.get("reachable") and engine.get("last_error"):
        reachable += f": {engine['last_error']}{_retry(engine)}"
    lines.append(f"engine    {engine.get('url')}  {reachable}")
    engines = answer.get("engines", [])
    if len(engines) > 1:
        lines.extend(_engine_line(e) for e in engines)
    for engine_nodes in (e.get("nodes", []) for e in engines):
        lines.extend(_node_line(n) for n in engine_nodes)
    if answer.get("serving") and "rollback" in answer:
        back = answer["rollback"]
        lines.append(  # the target, not a rollback that happened: "to", "if a reload fails"
            f"rollback  to {back} if a reload fails"
            if back
            else "rollback  NONE: a failed reload has no intact good checkpoint to go back to"
        )
    if answer.get("pinned"):
        lines.append(_pinned(answer))
    if answer.get("reloading"):
        lines.append(f"reloading {answer['reloading']}")
    if gating := answer.get("gating"):
        read = (
            f"{gating['done'] / 1e9:.2f} of {gating['total'] / 1e9:.2f} GB read"
            if gating["total"]
            else "headers"
        )
        lines.append(f"gating    {gating['name']}: {read}")
    last = answer.get("last_reload")
    if last and last.get("rolled_back_to"):
        lines.append(f"last      {last['version']}{_rolled_back(last)}, {_ago(last['at'])} ago")
    elif last:
        lines.append(f"last      {last['version']} in {last['duration_ms']:.0f} ms, {_ago(last['at'])} ago")
    pending, rejected = answer.get("pending", {}), answer.get("rejected", {})
    lines.append(f"pending   {len(pending)}")
    lines.extend(f"  {name}: {reason}" for name, reason in pending.items())
    lines.append(f"rejected  {len(rejected)}")
    lines.extend(f"  {name}{_content(r)}: {r['reason']}" for name, r in rejected.items())
    if passed := answer.get("passed_over", {}):
        lines.append(f"passed over {len(passed)}")
        lines.extend(f"  {name}: {why}" for name, why in passed.items())
    for name, found in (answer.get("adapters") or {}).items():
        held = ", ".join(f"{url}: {version or '-'}" for url, version in found["engines"].items())
        lines.append(
            f"adapter   {name}  newest {found['newest'] or '-'}, last good {found['last_good'] or '-'}"
        )
        lines.append(f"          serving {held}")
        lines.extend(
            f"          rejected {version}: {reason}" for version, reason in found["rejected"].items()
        )
        lines.extend(
            f"          waiting {version}: {reason}" for version, reason in found.get("waiting", {}).items()
        )
    return "\n".join(printable(text) for text in lines)
