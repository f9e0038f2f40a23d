"""Zero exposure: a real HAProxy in front of two real CPU vLLM engines, health-checking the
daemon's readiness endpoint (`[readiness] drain = true`), clients on it all along, through
three rolling updates and one checkpoint that breaks the forward pass. No request fails, none is
answered by an engine while it is paused, no engine is paused while HAProxy still sends it
traffic, and no client ever gets an answer from the failing checkpoint. Then the same with
drain off on the same engines, and both side by side, as bench/drain.py runs them (the same
`roll`, `drain_counts` and `side_by_side`; the script itself only starts engines around them)."""

from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

import pytest

from tests.support.balancer import Answer, held_through_a_pause, paused_in_rotation, pauses
from tests.support.rolling_updates import GRACE, Run, drain_counts, roll, side_by_side, two_engines
from vllm_reloader.tools.publish import publish

pytestmark = pytest.mark.engine


def _at(line: dict[str, object]) -> float:
    return datetime.fromisoformat(str(line["timestamp"])).timestamp()


def _around(run: Run, answer: Answer) -> str:
    """What the daemon, the samplers and HAProxy said around a held answer (to find why)."""
    begin, end = answer.sent - 6, answer.done + 1
    lines = [
        f"{_at(e) - answer.sent:+.3f} {e['event']} {e.get('engine', '')} {e.get('version', '')} "
        f"{ {k: e[k] for k in ('drained', 'in_flight_at_pause', 'drain_ms', 'cause', 'reason') if k in e} }"
        for e in run.lines
        if begin <= _at(e) <= end
    ]
    seen = [s for server, samples in run.paused.items() if server == answer.server for s in samples]
    paused = [p for p in pauses(seen) if p.until > begin and p.since < end]
    states = [(round(s.asked - answer.sent, 3), s.value) for s in run.states if begin <= s.asked <= end]
    return f"{answer}\npauses {paused}\nhaproxy {states[::5]}\n" + "\n".join(lines)


def _zero_exposure(run: Run, first: str, second: str) -> None:
    """What the drain promises, judged before anything else runs on the engines."""
    answers = run.quiet + run.updates
    assert run.updates and run.quiet, "clients were answered before and through the updates"
    failed = [a for a in answers if a.status != 200]
    assert failed == [], f"no request failed: {_around(run, failed[0]) if failed else ''}"
    assert all(a.passed_on for a in answers), "HAProxy says when it passed each request on"
    assert len(set(run.good.values())) == 4, f"each good version answers its own way: {run.good}"
    foreign = [a for a in answers if a.text not in run.good.values()]
    assert foreign == [], "an answer from no good version: the failing checkpoint's"
    held = held_through_a_pause(answers, run.paused)
    assert held == [], f"no request waited on a paused engine: {_around(run, held[0]) if held else ''}"
    in_rotation = paused_in_rotation(run.paused, run.states)
    if in_rotation:  # what was said around the first such moment
        server, at = in_rotation[0]
        moment = Answer(at, at, server, None, None)
        pytest.fail(f"paused only once HAProxy took it out: {_around(run, moment)}")
    assert {a.server for a in run.updates} == {"0", "1"}

    rolled = run.events("reload.rolled_back", engine=first, version="step-5")
    assert len(rolled) == 1 and rolled[0]["cause"] == "probe" and rolled[0]["to_version"] == "step-4"
    assert not run.events("reload.started", engine=second, version="step-5"), "the follower never had it"
    for url, server in ((first, "0"), (second, "1")):
        # Each pause held 2.5 s (a sampler's read takes up to 1 s on a saturated host): every
        # reload, the rollback included, is seen paused, so the checks above cover each one.
        reloads = run.events("reload.started", engine=url)
        seen = pauses(run.paused[server])
        assert len(seen) >= len(reloads) >= 3, f"every reload of {url} seen paused: {seen}"
        for done in run.events("reload.succeeded", engine=url):
            assert done["in_flight_at_pause"] == 0 and float(str(done["drain_ms"])) >= GRACE * 1000
            back = _at(done)  # said before the engine goes back: every answer of it comes later
            new = run.good[str(done["version"])]
            early = [a for a in run.updates if a.server == server and a.text == new and a.done < back]
            assert early == [], f"{url} answered {done['version']} before it passed its canary"


def test_e2e_haproxy_sends_no_client_to_a_paused_or_unverified_engine_through_updates_and_a_failing_canary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    from vllm_reloader.tools.tinymodel import write_checkpoint

    root = tmp_path / "root"
    seeds = [write_checkpoint(tmp_path / f"seed-{i}", seed=i) for i in range(1, 5)]
    publish(seeds[0], root, step=1)
    engines = two_engines(root / "step-1", tmp_path)
    try:
        run = roll(
            tmp_path / "drain",
            engines,
            root,
            seeds[1:],
            seeds[0],
            first_step=2,
            drain=True,
            hold_pauses_s=2.5,
        )
        first, second = (e.url for e in engines)
        _zero_exposure(run, first, second)  # judged before the drain-off half can fail
        shutil.rmtree(root / "step-5")  # rejected by the first daemon: not the second's to find
        off = roll(tmp_path / "off", engines, root, seeds[1:], seeds[0], first_step=6, drain=False)
    finally:
        for engine in engines:
            engine.stop()
    on, without = drain_counts(run), drain_counts(off)  # bench/drain.py's figures
    assert on["failed"] == on["failing_checkpoint_answers"] == on["held_through_a_pause"] == 0
    assert without["requests"] and set(without["updates"]) >= {"p50_ms", "p99_ms", "max_ms"}  # type: ignore[arg-type]
    with capsys.disabled():  # the latency tail through the reloads, next to none, drain on and off
        print("\n" + side_by_side(on, without))
