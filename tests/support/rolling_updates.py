"""Rolling updates behind a real HAProxy, with clients on it all along: the scenario of the
zero-exposure test (tests/e2e/test_e2e_balancer.py) and of bench/drain.py, which runs it with
`[readiness] drain` on and off. A quiet stretch first gives the latency without reloads."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import background
from tests.support.balancer import (
    MAX_TOKENS,
    PROMPT,
    Answer,
    Clients,
    Samples,
    States,
    held_through_a_pause,
    paused_in_rotation,
    start_haproxy,
    tail,
)
from tests.support.checkpoints import write_manifest
from tests.support.engine_fixtures import DaemonProcess, Engine, daemon_config, exploding, start_engine
from tests.support.ports import unused_port
from vllm_reloader.tools.publish import publish

GRACE = 0.5
"""The drain's grace: five of HAProxy's check intervals."""


def two_engines(model: Path, directory: Path) -> list[Engine]:
    """Two real CPU engines started on `model` side by side, each bound to its own core."""
    with ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(
                start_engine,
                model,
                directory / f"{n}.log",
                env={"VLLM_CPU_OMP_THREADS_BIND": core},
                args=("--enable-server-load-tracking",),  # as docs/operations.md asks, with drain
            )
            for n, core in (("first", "0"), ("second", "1"))
        ]
        return [f.result() for f in starting]


@contextmanager
def holding(holds: Path, seconds: float) -> Iterator[None]:
    """While in it, every reload's pause lasts `seconds` at least: the daemon holds at
    `after_pause` (the engine paused, its weights untouched) until the hold file goes."""
    stop = threading.Event()
    hold, held = holds / "after_pause.hold", holds / "after_pause.held"

    def hold_each() -> None:
        while not stop.is_set():
            hold.touch()
            while not held.exists() and not stop.wait(0.01):
                pass
            stop.wait(seconds)
            hold.unlink(missing_ok=True)
            while held.exists() and not stop.wait(0.01):
                pass
        hold.unlink(missing_ok=True)

    threads = [threading.Thread(target=hold_each, daemon=True)] if seconds else []
    with background.running(threads, stop, join_s=10):
        yield


def text_of(engine: Engine) -> str:
    """The engine's greedy answer to the clients' prompt, asked directly (not through HAProxy)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = engine.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


@dataclass
class Run:
    """What the clients, the samplers and the daemon saw."""

    drain: bool
    quiet: list[Answer]
    """Answers before the first publish: no reload."""
    updates: list[Answer]
    """Answers from the first publish on: three rolling updates and one checkpoint that fails its probe."""
    paused: Samples
    states: States
    good: dict[str, str]
    """Each good version's greedy answer (asked of an engine serving it, directly)."""
    lines: list[dict[str, object]] = field(default_factory=list)
    """The daemon's log."""

    def events(self, event: str, /, **fields: object) -> list[dict[str, object]]:
        return [e for e in self.lines if e.get("event") == event and fields.items() <= e.items()]


def roll(
    base: Path,
    engines: Sequence[Engine],
    root: Path,
    good: Sequence[Path],
    bad_from: Path,
    *,
    first_step: int,
    drain: bool,
    quiet_s: float = 8.0,
    hold_pauses_s: float = 0.0,
) -> Run:
    """A daemon on `engines` (serving ROOT's newest already), HAProxy in front, clients on
    it; then `good` published one after the other, each rolled over every engine, then a
    checkpoint made from `bad_from` that fails its probe on the first engine. Returns once the
    first engine is back in HAProxy after its rollback. `hold_pauses_s`: every pause lasts at
    least that long (failpoint `after_pause`), so that the samplers see each one."""
    readiness = unused_port()
    config = daemon_config(
        base / "daemon.toml",
        root=root,
        engine_url=[e.url for e in engines],
        state_dir=base / "state",
        engine_extra="check_interval = 0.5\n",
    )
    with config.open("a") as f:
        f.write(f'[readiness]\nlisten = "127.0.0.1:{readiness}"\ndrain = {str(drain).lower()}\n')
        f.write(f"grace = {GRACE}\ndrain_timeout = 30\n")
    holds = base / "holds"
    holds.mkdir(parents=True, exist_ok=True)
    daemon = DaemonProcess(config, env={"VLLM_RELOADER_FAILPOINT_DIR": str(holds)} if hold_pauses_s else None)
    first, last = engines[0], engines[-1]
    try:
        for engine in engines:
            daemon.wait_for("engine.reconciled", engine=engine.url, timeout=120)
        serving = str(daemon.events("engine.reconciled", engine=first.url)[-1]["version"])
        texts = {serving: text_of(first)}
        balancer = start_haproxy([e.url for e in engines], readiness, base / "haproxy")
        try:
            balancer.wait_all_up(len(engines))
            with Clients(balancer, engines).running() as clients, holding(holds, hold_pauses_s):
                threading.Event().wait(quiet_s)
                started = time.time()
                step = first_step
                for checkpoint in good:
                    publish(checkpoint, root, step=step)
                    version = f"step-{step}"
                    daemon.wait_for("reload.succeeded", engine=last.url, version=version, timeout=300)
                    texts[version] = text_of(last)
                    step += 1
                staged = exploding(bad_from, base / "staged" / f"step-{step}")
                write_manifest(staged, step=step, overrides={"version": f"step-{step}"})
                staged.rename(root / f"step-{step}")
                daemon.wait_for("reload.rolled_back", engine=first.url, version=f"step-{step}", timeout=300)
                daemon.wait_for("checkpoint.rejected", name=f"step-{step}", timeout=60)
                balancer.wait_all_up(len(engines))
                threading.Event().wait(1.0)
        finally:
            balancer.stop()
    finally:
        code = daemon.stop()
    assert code == 0, "".join(daemon.raw[-20:])
    answers = list(clients.answers)
    return Run(
        drain=drain,
        quiet=[a for a in answers if a.sent < started],
        updates=[a for a in answers if a.sent >= started],
        paused=clients.paused,
        states=clients.states,
        good=texts,
        lines=list(daemon.lines),
    )


def drain_counts(run: Run) -> dict[str, object]:
    """What bench/drain.py reports of one run: failures, answers held through a pause, pauses
    HAProxy still sent traffic into, answers from the failing checkpoint, latency tails."""
    answers = run.quiet + run.updates
    waited = held_through_a_pause(answers, run.paused)
    return {
        "requests": len(answers),
        "failed": sum(a.status != 200 for a in answers),
        "held_through_a_pause": len(waited),
        "longest_wait_ms": round(max((a.seconds for a in waited), default=0.0) * 1000, 1),
        "paused_in_rotation_samples": len(paused_in_rotation(run.paused, run.states)),
        "failing_checkpoint_answers": sum(
            a.status == 200 and a.text not in run.good.values() for a in answers
        ),
        "no_reload": tail(run.quiet),
        "updates": tail(run.updates),
    }


def side_by_side(on: dict[str, object], off: dict[str, object]) -> str:
    """Drain on and off, a row per figure."""
    rows = [f"{'drain':<30}{'on':>12}{'off':>12}"]
    for row, value in on.items():
        pairs = value.items() if isinstance(value, dict) else [("", value)]
        for stat, on_value in pairs:
            off_value = off[row][stat] if stat else off[row]  # type: ignore[index]
            rows.append(f"{(row + ' ' + stat).strip():<30}{on_value!s:>12}{off_value!s:>12}")
    return "\n".join(rows)
