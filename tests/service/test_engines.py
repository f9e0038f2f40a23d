"""The engines of one host: answers reach the loop, and a shutdown does not wait on a hung
engine for longer than it says."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import structlog

from tests.support.fake_engine import FakeEngine
from vllm_reloader.config import EngineConfig
from vllm_reloader.engine.client import EngineClient
from vllm_reloader.errors import EngineNotSetUp, EngineUnavailable
from vllm_reloader.service.engines import Engines
from vllm_reloader.service.jobs import Answered, Ask, Report
from vllm_reloader.service.metrics import Metrics
from vllm_reloader.service.scheduler import Work

URLS = ["http://engine-0.test", "http://engine-1.test", "http://engine-2.test"]


def engines(reports: list[Report]) -> Engines:
    config = EngineConfig(urls=URLS, retry_initial=0.05)
    clients = {url: FakeEngine().client(url) for url in URLS}
    made = Engines(config, (None, ()), reports.append, structlog.get_logger(), Metrics(), clients)
    made.start()
    return made


def ask(
    host: Engines,
    n: int,
    call: Callable[[EngineClient], object],
    then: Callable[[object], None],
    kind: str = "check",
) -> None:
    """What a scheduler starts: `call` on engine n's thread, `then` with its answer on the loop."""
    scheduler = host.schedulers[n]
    scheduler.start(Work(kind, Ask(scheduler.engine.client, call), then), None)


def test_engines_close_waits_for_hung_calls_once_in_all_not_once_per_engine():
    reports: list[Report] = []
    host = engines(reports)
    release = threading.Event()
    for n in range(len(URLS)):
        ask(host, n, lambda _client: release.wait(30), lambda _: None)
    host.close(wait=0.3)
    try:
        assert all(s.worker.is_alive() for s in host.schedulers), "it returned while every call still hung"
    finally:
        release.set()
    for scheduler in host.schedulers:
        scheduler.worker._thread.join(5)
        assert not scheduler.worker.is_alive(), "and each thread ends once its call does"


def test_engines_answer_reaches_the_engine_that_asked_and_a_failure_backs_it_off():
    reports: list[Report] = []
    host = engines(reports)
    seen: list[object] = []
    try:
        first, second = host.all[0], host.all[1]
        ask(host, 0, lambda client: client.weight_version(), seen.append)
        ask(host, 1, fails(EngineUnavailable("gone", endpoint="/x")), seen.append)
        for _ in range(2):
            answer = next_report(reports)
            host.finished(answer)
        assert seen == ["default"], "the failed call's continuation never ran"
        assert first.served.up and host.idle(first)
        assert not second.served.up and host.idle(second) and second.retry_at() > time.monotonic()
    finally:
        host.close()


def test_engines_answer_to_a_question_asked_before_a_regroup_is_dropped():
    reports: list[Report] = []
    host = engines(reports)
    seen: list[object] = []
    try:
        ask(host, 0, lambda client: client.weight_version(), seen.append)
        host.regroup(EngineConfig(urls=URLS, retry_initial=0.05), (None, ()))
        host.finished(next_report(reports))
        assert seen == [] and host.idle(host.all[0])
    finally:
        host.close()


def test_engines_engine_not_set_up_on_its_thread_reaches_the_loop():
    reports: list[Report] = []
    host = engines(reports)
    seen: list[object] = []
    try:
        ask(host, 0, fails(EngineNotSetUp("dev mode off")), seen.append)
        with pytest.raises(EngineNotSetUp, match="dev mode off"):
            host.finished(next_report(reports))
    finally:
        host.close()


def fails(error: Exception) -> Callable[[EngineClient], object]:
    def call(_client: EngineClient) -> object:
        raise error

    return call


def next_report(reports: list[Report], timeout: float = 5.0) -> Answered:
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        answers = [r for r in reports if isinstance(r, Answered)]
        if answers:
            reports.remove(answers[0])
            return answers[0]
        done.wait(0.01)
    raise AssertionError("no answer came back")


def test_engines_dropped_engine_owed_a_resume_is_resumed_on_its_own_thread_not_the_loops():
    """A SIGHUP drops an engine whose resume failed (it did not answer): the loop lets it go at
    once; its thread resumes it, then closes its client."""
    reports: list[Report] = []
    host = engines(reports)
    dropped, thread = host.all[2], host.schedulers[2].worker
    release, resumed = threading.Event(), threading.Event()

    def resume() -> None:
        release.wait(30)
        resumed.set()

    dropped.client.resume = resume  # type: ignore[method-assign]
    dropped.served.resume_owed = True
    try:
        host.regroup(EngineConfig(urls=URLS[:2], retry_initial=0.05), (None, ()))
        assert [e.url for e in host] == URLS[:2] and not resumed.is_set(), "the loop did not wait"
        release.set()
        assert resumed.wait(5), "its thread resumed it"
        thread._thread.join(5)
        assert not thread.is_alive()
    finally:
        release.set()
        host.close()


def test_engines_follower_whose_retry_time_passed_sets_no_deadline_that_would_spin_the_loop():
    reports: list[Report] = []
    host = engines(reports)
    try:
        follower, scheduler = host.all[1], host.schedulers[1]
        follower.served.reconciled, follower.served.next_check = True, time.monotonic() + 60
        follower.last_error = "HTTP 500"
        follower.follow.failed(follower.url)
        assert min(scheduler.deadlines()) == follower.retry_at_follow()
        follower.follow.succeeded(follower.url)  # due, but no room now: a freed place wakes it
        follower.follow._until[follower.url] = (time.monotonic() - 1, 1)
        assert min(scheduler.deadlines()) == follower.served.next_check
    finally:
        host.close()
