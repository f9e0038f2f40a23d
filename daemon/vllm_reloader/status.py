"""What the daemon tells its operators: the control socket's `status` answer, the one line
systemd shows (`STATUS=`), and the on-call view `vllm-reloader status` prints."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .daemon import Daemon


def answer(daemon: Daemon) -> dict[str, Any]:
    reloader, remote = daemon.reloader, daemon.remote
    state = reloader.state
    pending = {name: reason for name, (_, reason) in sorted(reloader.last_report.items())}
    found: dict[str, Any] = {
        "serving": state.serving.model_dump() if state.serving else None,
        "last_good": state.last_good.model_dump() if state.last_good else None,
        "last_reload": reloader.last_reload,
        "reloading": reloader.in_flight.target.version if reloader.in_flight else None,
        "pinned": state.pinned,
        "pending": pending | (remote.pending if remote else {}),
        "rejected": {name: r.model_dump() for name, r in sorted(state.rejected.items())},
        "engine": {"url": reloader.config.engine.url, "reachable": reloader.engine_up},
    }
    if remote:
        found["source"] = {"url": remote.config.source.path, "failing": dict(remote.problems)}
    return found


def line(daemon: Daemon) -> str:
    """One line for systemd's STATUS=: what is served, since when, what waits."""
    reloader = daemon.reloader
    serving = reloader.state.serving
    parts = [
        f"serving {serving.version} since {time.strftime('%H:%M:%S', time.localtime(serving.since))}"
        if serving
        else "waiting for the engine"
    ]
    if reloader.in_flight is not None:
        parts.append(f"reloading {reloader.in_flight.target.version}")
    pending = [n for n, (status, _) in reloader.last_report.items() if status == "pending"]
    parts.append(f"{len(pending) + len(daemon.remote.pending if daemon.remote else {})} pending")
    if reloader.last_scan:
        parts.append(f"last scan {time.time() - reloader.last_scan:.0f} s ago")
    if daemon.remote and daemon.remote.problems:
        parts.append("object store failing")
    return "; ".join(parts)


def _ago(timestamp: float) -> str:
    seconds = max(0, int(time.time() - timestamp))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def render(answer: dict[str, Any]) -> str:
    """The on-call view: one fact per line, reasons in full."""
    serving = answer.get("serving")
    lines = []
    if serving:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(serving["since"]))
        lines.append(f"serving   {serving['version']}  since {since} ({_ago(serving['since'])} ago)")
        lines.append(f"          {serving['path']}")
    else:
        lines.append("serving   (unknown: waiting for the engine)")
    engine = answer.get("engine", {})
    lines.append(
        f"engine    {engine.get('url')}  {'reachable' if engine.get('reachable') else 'UNREACHABLE'}"
    )
    if answer.get("pinned"):
        lines.append(f"pinned    {answer['pinned']}  (not auto-advancing; `vllm-reloader unpin` resumes)")
    if answer.get("reloading"):
        lines.append(f"reloading {answer['reloading']}")
    last = answer.get("last_reload")
    if last:
        lines.append(f"last      {last['version']} in {last['duration_ms']:.0f} ms, {_ago(last['at'])} ago")
    pending, rejected = answer.get("pending", {}), answer.get("rejected", {})
    lines.append(f"pending   {len(pending)}")
    lines.extend(f"  {name}: {reason}" for name, reason in pending.items())
    lines.append(f"rejected  {len(rejected)}")
    lines.extend(f"  {name}: {r['reason']}" for name, r in rejected.items())
    return "\n".join(lines)
