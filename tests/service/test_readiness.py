"""Readiness for the load balancer: `GET /ready/<n>` over a real socket, and an engine drained
out of rotation before its pause, back only after its canary (or its rollback)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.support.checkpoints import MakeCheckpoint
from tests.support.fake_engine import FakeEngine
from tests.support.ports import unused_port
from vllm_reloader import config
from vllm_reloader.errors import ConfigError
from vllm_reloader.service import readiness
from vllm_reloader.service.readiness import NOT_YET, Drain, ReadinessServer, Rotation


@pytest.fixture
def served() -> Iterator[tuple[Rotation, str]]:
    rotation = Rotation(["http://a", "http://b"])
    server = ReadinessServer("127.0.0.1:0", rotation)
    server.start()
    yield rotation, f"http://127.0.0.1:{server.port}"
    server.close()


def test_readiness_is_503_until_reconciled_then_200_and_names_why_an_engine_is_out(served):
    rotation, base = served
    answer = httpx.get(f"{base}/ready/0")
    assert (answer.status_code, answer.text) == (503, f"down: {NOT_YET}\n")
    rotation.put_back("http://a", "down")
    assert httpx.get(f"{base}/ready/0").status_code == 200
    assert httpx.get(f"{base}/ready/1").status_code == 503, "each engine on its own"
    rotation.take_out("http://a", "drain", "out of rotation for a reload")
    answer = httpx.get(f"{base}/ready/0")
    assert (answer.status_code, answer.text) == (503, "drain: out of rotation for a reload\n")
    rotation.put_back("http://a", "drain")
    assert httpx.get(f"{base}/ready/0?probe=1").status_code == 200


@pytest.mark.parametrize(
    "path", ["/ready/2", "/ready/x", "/ready/", "/ready/0/x", "/metrics", "/ready/\u0660", "/ready/a:80"]
)
def test_readiness_answers_404_to_what_names_no_engine(served, path: str):
    _, base = served
    answer = httpx.get(f"{base}{path}")
    assert answer.status_code == 404 and "N from 0 to 1" in answer.text


def test_readiness_by_address_answers_for_the_same_engine_after_a_sighup_reorders_urls(served):
    rotation, base = served
    rotation.put_back("http://b", "down")
    assert [httpx.get(f"{base}/ready/{name}").status_code for name in ("a", "b", "1")] == [503, 200, 200]
    rotation.track(["http://b", "http://a"])  # a SIGHUP that reordered `urls`
    assert [httpx.get(f"{base}/ready/{name}").status_code for name in ("a", "b", "1")] == [503, 200, 503]


def test_readiness_engines_a_sighup_adds_start_out_and_kept_ones_keep_their_state():
    rotation = Rotation(["http://a"])
    rotation.put_back("http://a", "down")
    rotation.track(["http://a", "http://c"])
    assert rotation.why_out("http://a") is None and rotation.why_out("http://c") == f"down: {NOT_YET}"


def test_readiness_listen_taken_is_a_config_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError, match=r"^readiness\.listen 127\.0\.0\.1:\d+: cannot listen"):
            ReadinessServer(f"127.0.0.1:{taken.getsockname()[1]}", Rotation(["http://a"]))


def test_readiness_drain_without_listen_is_a_config_error():
    text = (
        '[source]\npath = "/r"\n[engine]\nurl = "http://e"\n[state]\ndir = "/s"\n[readiness]\ndrain = true\n'
    )
    with pytest.raises(ConfigError, match="drain = true needs listen"):
        config.parse(text)


def two_in_rotation() -> Rotation:
    rotation = Rotation(["http://a", "http://b"])
    for url in rotation.urls:
        rotation.put_back(url, "down")
    return rotation


def test_drain_waits_its_grace_then_until_nothing_is_in_flight():
    rotation, stop = two_in_rotation(), threading.Event()
    answers = iter([4, 2, 0, 1, 0, 0])
    drained = Drain(rotation, grace=0.05, timeout=60.0, stop=stop).out("http://a", lambda: next(answers))
    assert drained is not None and drained["in_flight_at_pause"] == 0 and drained["drain_ms"] >= 50
    assert list(answers) == [], "asked until nothing was in flight twice in a row, then no more"
    assert "drain" in (rotation.why_out("http://a") or ""), "back only once the loop saw the reload end"


def test_drain_gives_up_at_its_timeout_and_a_stop_ends_it_pausing_nothing():
    rotation, stop = two_in_rotation(), threading.Event()
    drained = Drain(rotation, grace=0.0, timeout=0.3, stop=stop).out("http://a", lambda: 7)
    assert drained is not None and drained["in_flight_at_pause"] == 7 and drained["drain_ms"] >= 300
    stop.set()
    assert Drain(rotation, grace=60.0, timeout=60.0, stop=stop).out("http://a", lambda: 7) is None


def later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


def test_drain_waits_past_its_grace_until_a_health_check_has_read_the_engine_out_and_asked_again():
    rotation, stop = two_in_rotation(), threading.Event()
    assert rotation.asked("http://a") is None, "a balancer reads it"
    said: list[str | None] = []
    check = lambda: said.append(rotation.asked("http://a"))  # noqa: E731
    checks = [later(0.3, check), later(0.6, check)]  # checks slower than the grace
    drained = Drain(rotation, grace=0.05, timeout=30.0, stop=stop).out("http://a", lambda: 0)
    for checker in checks:
        checker.join()
    assert said == ["drain: out of rotation for a reload"] * 2 and drained is not None
    assert 600 <= drained["drain_ms"] < 30_000 and drained["in_flight_at_pause"] == 0


def test_drain_does_not_count_a_read_out_whose_answer_may_still_be_on_its_way():
    """HAProxy acts on a 503 once it has taken it in, and a slow check takes most of a second on
    a busy host: only its next check proves it did."""
    rotation, stop = two_in_rotation(), threading.Event()
    rotation.asked("http://a")
    checker = later(0.1, lambda: rotation.asked("http://a"))  # read out once, then no more
    drained = Drain(rotation, grace=0.0, timeout=0.5, stop=stop).out("http://a", lambda: 0)
    checker.join()
    assert drained is not None and drained["drain_ms"] >= 500, "waited to its deadline"


def test_drain_waits_only_its_grace_where_no_balancer_checks_the_engines(monkeypatch):
    monkeypatch.setattr(readiness, "WATCHED_WITHIN", 0.2)
    rotation, stop = two_in_rotation(), threading.Event()
    rotation.asked("http://a")  # an operator's curl, long ago: no balancer to wait for
    time.sleep(0.3)
    drained = Drain(rotation, grace=0.05, timeout=30.0, stop=stop).out("http://a", lambda: 0)
    assert drained is not None and drained["drain_ms"] < 10_000 and drained["in_flight_at_pause"] == 0


def test_drain_takes_nothing_out_until_the_engine_put_back_before_it_is_seen_back():
    rotation, stop = two_in_rotation(), threading.Event()
    rotation.take_out("http://b", "drain", "out of rotation for a reload")
    assert rotation.asked("http://b") is not None, "the balancer saw b out"
    rotation.put_back("http://b", "drain")  # b's reload ended: back, but not seen back yet
    assert rotation.others_ready("http://a") and not rotation.others_ready("http://a", seen_within=5.0)
    seen_a: list[str | None] = []

    def check_b() -> None:
        seen_a.append(rotation.why_out("http://a"))
        rotation.asked("http://b")

    checkers = [later(0.3, check_b), later(0.6, check_b)]  # it reads b ready, then asks again
    drained = Drain(rotation, grace=0.0, timeout=30.0, stop=stop).out("http://a", lambda: 0)
    for checker in checkers:
        checker.join()
    assert seen_a == [None, None], "a stayed in rotation while b was not seen back"
    assert drained is not None and drained["drain_ms"] >= 600 and "drained" not in drained
    assert rotation.why_out("http://a") == "drain: out of rotation for a reload"


def test_drain_takes_nothing_out_while_the_answer_that_an_engine_is_back_may_be_on_its_way():
    """HAProxy marked the one before up only once it took in a slow 200; a 503 for the next,
    answered meanwhile, left it none. A checker asks again only after taking in its last answer."""
    rotation = two_in_rotation()
    rotation.take_out("http://b", "drain", "out of rotation for a reload")
    rotation.asked("http://b")
    rotation.put_back("http://b", "drain")
    assert rotation.asked("http://b") is None, "the balancer is told b is back: not taken in yet"
    assert not rotation.others_ready("http://a", seen_within=5.0)
    rotation.asked("http://b")
    assert rotation.others_ready("http://a", seen_within=5.0), "its next check: b is back for it"
    rotation.take_out("http://b", "drain", "out of rotation for a reload")
    rotation.asked("http://b")
    assert not rotation.others_ready("http://a", seen_within=5.0), "read out again: a streak starts anew"


def test_drain_reloads_in_place_when_no_other_engine_is_seen_back_within_its_timeout():
    rotation, stop = two_in_rotation(), threading.Event()
    rotation.take_out("http://b", "drain", "out of rotation for a reload")
    rotation.asked("http://b")
    rotation.put_back("http://b", "drain")  # and no check reads it again: the balancer is gone
    drained = Drain(rotation, grace=0.0, timeout=0.2, stop=stop).out("http://a", lambda: 0)
    assert drained is not None and drained["drained"] is False and drained["drain_ms"] >= 200
    assert rotation.why_out("http://a") is None, "never taken out: a balancer with none would refuse all"


def test_readiness_server_says_nothing_when_a_check_goes_away_before_its_answer(capfd):
    import struct

    rotation = two_in_rotation()
    server = ReadinessServer("127.0.0.1:0", rotation)
    server.start()
    try:
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", server.port)) as client:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.sendall(b"GET /ready/0 HTTP/1.1\r\nHost: x\r\n\r\n")  # then reset
        assert httpx.get(f"http://127.0.0.1:{server.port}/ready/0").status_code == 200
    finally:
        server.close()
    assert "Traceback" not in capfd.readouterr().err


def test_readiness_server_answers_head_and_ipv6_and_refuses_huge_numbers():
    rotation = Rotation(["http://a"])
    rotation.put_back("http://a", "down")
    server = ReadinessServer("[::1]:0", rotation)
    server.start()
    try:
        base = f"http://[::1]:{server.port}"
        assert httpx.head(f"{base}/ready/0").status_code == 200
        assert httpx.get(f"{base}/ready/{'9' * 5000}").status_code == 404
    finally:
        server.close()


def test_engine_metrics_that_are_not_numbers_are_unknown_in_flight():
    engine = FakeEngine()
    for value in ("NaN", "+Inf", "-3"):
        text = f'vllm:num_requests_running{{model_name="m"}} {value}\n'
        engine.fail["/metrics"] = lambda text=text: httpx.Response(200, text=text)
        assert engine.client().requests_in_flight() is None, value


def test_engine_requests_in_flight_count_those_its_http_handlers_hold_where_it_tracks_them():
    engine = FakeEngine()
    engine.requests_running = engine.requests_waiting = 0
    client = engine.client()
    assert client.requests_in_flight() == 0 and client.requests_in_flight() == 0
    assert engine.calls.count("/load") == 1, "not tracked there: asked once, then only /metrics"
    tracking = FakeEngine()
    tracking.requests_running, tracking.requests_waiting, tracking.server_load = 0, 1, 3
    assert tracking.client().requests_in_flight() == 3, "one read, two still tokenized: 3 held"
    tracking.server_load = 0
    assert tracking.client().requests_in_flight() == 1, "the scheduler's count when it is more"


def readiness_config(**drain: object) -> config.ReadinessConfig:
    return config.ReadinessConfig(listen=f"127.0.0.1:{unused_port()}", **drain)  # type: ignore[arg-type]


def ready(running, n: int) -> tuple[int, str]:
    listen = running.daemon.config.readiness.listen
    answer = httpx.get(f"http://{listen}/ready/{n}", timeout=5)
    return answer.status_code, answer.text.strip()


@contextmanager
def checking(running, engines: int) -> Iterator[None]:
    """A balancer's health checks: each engine's readiness read every 50 ms."""
    done = threading.Event()

    def check() -> None:
        while not done.wait(0.05):
            for n in range(engines):
                ready(running, n)

    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@pytest.mark.parametrize("release", ["0.32.0", "0.34.0"])
def test_daemon_takes_an_engine_out_of_rotation_before_its_pause_and_back_after_its_canary(
    start, root, make_checkpoint: MakeCheckpoint, release: str
):
    """Drained, it pauses in `wait` on every release: what slipped in finishes on the old
    weights (on 0.33+ a request arriving after every balancer read it out gets 503, and on
    0.34 this pause clears the KV cache the reload may borrow)."""
    make_checkpoint("step-1", step=1, root=root)
    canary_engine, follower = FakeEngine(str(root / "step-1")), FakeEngine(str(root / "step-1"))
    canary_engine.release = release
    canary_engine.requests_running = canary_engine.requests_waiting = 0
    follower.requests_running = follower.requests_waiting = 0
    seen: list[tuple[tuple[int, str], tuple[int, str], bool]] = []
    running = start(canary_engine, followers=[follower], readiness=readiness_config(drain=True, grace=0.2))
    canary_engine.during_load = lambda _path: seen.append(
        (ready(running, 0), ready(running, 1), canary_engine.paused)
    )
    listening = running.wait_for("readiness.listening")
    assert listening["drain"] == "rotation" and listening["engines"]["1"] == "http://engine2.test"
    running.wait_for("engine.reconciled", engine="http://engine2.test")
    running.wait_for("engine.reconciled", engine="http://engine.test")
    assert ready(running, 0) == (200, "ready") and ready(running, 1) == (200, "ready")
    with checking(running, 2):  # a balancer reads them: the drain waits for it to read the engine out
        make_checkpoint("step-2", step=2, root=root, seed=1)
        done = running.wait_for("reload.succeeded", version="step-2", engine="http://engine.test")
    assert seen == [((503, "drain: out of rotation for a reload"), (200, "ready"), True)]
    assert done["in_flight_at_pause"] == 0 and done["drain_ms"] >= 200
    assert canary_engine.pause_modes == ["wait"]
    assert ready(running, 0) == (200, "ready"), "back once its canary passed"


def test_daemon_keeps_an_engine_out_through_its_canary_and_rollback(
    start, root, make_checkpoint: MakeCheckpoint
):
    make_checkpoint("step-1", step=1, root=root)
    canary_engine, follower = FakeEngine(str(root / "step-1")), FakeEngine(str(root / "step-1"))
    canary_engine.requests_running = canary_engine.requests_waiting = 0
    statuses: list[int] = []
    running = start(canary_engine, followers=[follower], readiness=readiness_config(drain=True, grace=0.0))
    canary_engine.during_load = lambda _path: statuses.append(ready(running, 0)[0])
    running.wait_for("engine.reconciled", engine="http://engine.test")
    bad = make_checkpoint("step-2", step=2, root=root, seed=1)
    canary_engine.garbage.add(str(bad))
    running.wait_for("reload.rolled_back", timeout=20)
    assert statuses == [503, 503], "out while loading the bad weights and while loading the good ones back"
    assert ready(running, 0) == (200, "ready")


def test_daemon_with_one_engine_reloads_it_in_place_and_says_so(start, root, make_checkpoint: MakeCheckpoint):
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(str(root / "step-1"))
    statuses: list[int] = []
    running = start(engine, readiness=readiness_config(drain=True))
    engine.during_load = lambda _path: statuses.append(ready(running, 0)[0])
    assert running.wait_for("readiness.listening")["drain"] == "in place: one engine alone"
    running.wait_for("engine.reconciled")
    make_checkpoint("step-2", step=2, root=root, seed=1)
    done = running.wait_for("reload.succeeded", version="step-2")
    assert statuses == [200] and "drain_ms" not in done


def test_daemon_says_an_engine_that_stops_answering_is_not_ready(
    start, root, make_checkpoint: MakeCheckpoint
):
    from tests.support.fake_engine import unreachable

    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(str(root / "step-1"))
    running = start(engine, engine_check_interval=0.05, readiness=readiness_config())
    running.wait_for("engine.reconciled")
    assert ready(running, 0) == (200, "ready")
    engine.fail["/weight_info"] = unreachable()
    running.wait_for("engine.unreachable")
    status, why = ready(running, 0)
    assert status == 503 and why.startswith("down: ")


def two_engines(start, root, make_checkpoint, **drain: object):
    make_checkpoint("step-1", step=1, root=root)
    canary_engine, follower = FakeEngine(str(root / "step-1")), FakeEngine(str(root / "step-1"))
    for engine in (canary_engine, follower):
        engine.requests_running = engine.requests_waiting = 0
    readiness = readiness_config(drain=True, **{"grace": 0.0, **drain})
    running = start(canary_engine, followers=[follower], readiness=readiness, engine_check_interval=0.1)
    running.wait_for("engine.reconciled", engine="http://engine2.test")
    running.wait_for("engine.reconciled", engine="http://engine.test")
    return running, canary_engine, follower


def test_daemon_keeps_an_engine_whose_resume_failed_out_until_it_is_resumed(start, root, make_checkpoint):
    from tests.support.fake_engine import error

    running, engine, _ = two_engines(start, root, make_checkpoint)
    engine.fail["/resume"] = error(500, "resume refused")
    make_checkpoint("step-2", step=2, root=root, seed=1)
    running.wait_for("engine.resume_failed")
    status, why = ready(running, 0)
    assert status == 503 and "paused" in why
    del engine.fail["/resume"]
    running.wait_for("engine.resumed")
    deadline = time.monotonic() + 5
    while ready(running, 0)[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready(running, 0) == (200, "ready") and not engine.paused


def test_daemon_keeps_an_engine_whose_canary_failed_with_no_fallback_out(start, root, make_checkpoint):
    make_checkpoint("step-1", step=1, root=root)
    engine, follower = FakeEngine(str(root / "step-1")), FakeEngine(str(root / "step-1"))
    engine.requests_running = engine.requests_waiting = 0
    engine.garbage.add(str(root / "step-2"))
    running = start(engine, followers=[follower], readiness=readiness_config(drain=True, grace=0.0))
    running.wait_for("engine.reconciled", engine="http://engine.test")
    running.wait_for("engine.reconciled", engine="http://engine2.test")
    (root / "step-1").rename(root / ".gone-step-1")  # nothing intact to go back to
    make_checkpoint("step-2", step=2, root=root, seed=1)
    running.wait_for("reload.canary_failed_no_fallback", timeout=20)
    status, why = ready(running, 0)
    assert status == 503 and "did not end on verified weights" in why
    assert ready(running, 1) == (200, "ready")


def test_daemon_stopping_while_an_engine_drains_pauses_nothing(start, root, make_checkpoint):
    running, engine, _ = two_engines(start, root, make_checkpoint, grace=30.0)
    make_checkpoint("step-2", step=2, root=root, seed=1)
    deadline = time.monotonic() + 10
    while ready(running, 0)[0] != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready(running, 0)[0] == 503
    running.daemon.request_stop()
    running.wait_for("daemon.stopped", timeout=10)
    assert "/pause" not in engine.calls and not engine.paused


def test_daemon_reloads_in_place_when_no_other_engine_takes_traffic(start, root, make_checkpoint):
    from tests.support.fake_engine import unreachable

    running, engine, follower = two_engines(start, root, make_checkpoint)
    follower.fail["/weight_info"] = unreachable()
    running.wait_for("engine.unreachable", engine="http://engine2.test")
    statuses: list[int] = []
    engine.during_load = lambda _path: statuses.append(ready(running, 0)[0])
    make_checkpoint("step-2", step=2, root=root, seed=1)
    done = running.wait_for("reload.succeeded", version="step-2", engine="http://engine.test")
    assert statuses == [200] and "drain_ms" not in done, "taking it out would have left none"


def test_daemon_keeps_an_engine_found_paused_out_until_resumed(start, root, make_checkpoint):
    from tests.support.fake_engine import error

    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(str(root / "step-1"))
    engine.paused = True
    engine.fail["/resume"] = error(500, "not yet")
    running = start(engine, readiness=readiness_config(), engine_check_interval=0.1)
    running.wait_for("engine.reconciled")
    status, why = ready(running, 0)
    assert status == 503 and "paused" in why


def test_daemon_pauses_an_engine_its_drain_could_not_empty_as_configured_not_waiting_on_it(
    start, root, make_checkpoint: MakeCheckpoint
):
    running, engine, _ = two_engines(start, root, make_checkpoint, drain_timeout=0.3)
    engine.requests_running = 2  # a long generation outlives the drain
    make_checkpoint("step-2", step=2, root=root, seed=1)
    done = running.wait_for("reload.succeeded", version="step-2", engine="http://engine.test")
    assert done["in_flight_at_pause"] == 2
    assert engine.pause_modes == ["keep"], "vLLM's wait would block on it for pause_timeout"


def test_drain_waits_until_every_balancer_checking_the_engines_has_read_it_out():
    rotation, stop = two_in_rotation(), threading.Event()
    for reader in ("10.0.0.1", "10.0.0.2"):  # a pair of balancers
        rotation.asked("http://a", reader)
    checks = [
        later(at, lambda reader=reader: rotation.asked("http://a", reader))
        for at, reader in ((0.2, "10.0.0.1"), (0.3, "10.0.0.1"), (0.6, "10.0.0.2"), (0.7, "10.0.0.2"))
    ]
    drained = Drain(rotation, grace=0.05, timeout=30.0, stop=stop).out("http://a", lambda: 0)
    for checker in checks:
        checker.join()
    assert drained is not None and 700 <= drained["drain_ms"] < 30_000, "the second balancer took it in last"


def test_drain_ignores_a_balancer_gone_silent():
    rotation, stop = two_in_rotation(), threading.Event()
    rotation.asked("http://a", "10.0.0.9")
    rotation._readers["10.0.0.9"] -= 60  # its last check of anything: a minute ago
    drained = Drain(rotation, grace=0.05, timeout=30.0, stop=stop).out("http://a", lambda: 0)
    assert drained is not None and drained["drain_ms"] < 10_000


def test_rotation_takes_out_at_most_one_of_two_engines_whatever_the_order():
    rotation = two_in_rotation()
    assert rotation.take_out_if_others_ready("http://a", "drain", "out", None)
    assert not rotation.take_out_if_others_ready("http://b", "drain", "out", None), "b is the last one in"
    assert rotation.why_out("http://b") is None


def test_rotation_forgets_what_kept_an_engine_a_sighup_dropped_out():
    rotation = two_in_rotation()
    rotation.take_out("http://b", "drain", "out of rotation for a reload")
    rotation.track(["http://a"])
    rotation.take_out("http://b", "drain", "its reload thread, still at it")  # dropped: not put back in
    rotation.track(["http://a", "http://b"])
    assert rotation.why_out("http://b") == f"down: {NOT_YET}", (
        "new again: out until reconciled, no stale drain"
    )


def test_readiness_server_gives_a_client_trickling_its_request_one_deadline_for_the_whole_of_it(
    monkeypatch,
):
    monkeypatch.setattr(readiness, "REQUEST_DEADLINE", 0.5, raising=False)
    server = ReadinessServer("127.0.0.1:0", two_in_rotation())
    server.start()
    stop = threading.Event()

    def trickle() -> None:  # a byte every 0.2 s (no single read waits long), back when cut off
        while not stop.is_set():
            with socket.create_connection(("127.0.0.1", server.port)) as client:
                for byte in b"GET /ready/0 HTTP/1.1\r\nHost: x\r\n" * 4:
                    if stop.wait(0.2):
                        return
                    try:
                        client.sendall(bytes([byte]))
                    except OSError:
                        break

    clients = [threading.Thread(target=trickle, daemon=True) for _ in range(readiness.MAX_CLIENTS)]
    try:
        for client in clients:
            client.start()
        time.sleep(2.0)  # every slot taken by a trickling client (threads start slowly on 2 busy cores)
        answered = []
        deadline = time.monotonic() + 6.0
        while not answered and time.monotonic() < deadline:
            try:
                answered.append(httpx.get(f"http://127.0.0.1:{server.port}/ready/0", timeout=1.0))
            except httpx.HTTPError:
                time.sleep(0.05)
        assert answered and answered[0].status_code == 200, "the balancer's check got a slot"
    finally:
        stop.set()
        for client in clients:
            client.join()
        server.close()


def test_rotation_forgets_health_checkers_unseen_for_a_minute_so_a_new_balancer_is_waited_for():
    rotation, stop = two_in_rotation(), threading.Event()
    for n in range(readiness.MAX_READERS):  # a scan, or balancers replaced over the weeks
        rotation.asked("http://a", f"10.0.1.{n}")
    for reader in rotation._readers:
        rotation._readers[reader] -= 61  # all of them unseen for a minute
    rotation.asked("http://a", "10.0.0.1")  # the new balancer reads it ready
    checks = [later(at, lambda: rotation.asked("http://a", "10.0.0.1")) for at in (0.4, 0.6)]
    drained = Drain(rotation, grace=0.05, timeout=30.0, stop=stop).out("http://a", lambda: None)
    for checker in checks:
        checker.join()
    assert drained is not None and drained["drain_ms"] >= 600, "waited until the new balancer read it out"
    assert drained["drain_ms"] < readiness.WATCHED_WITHIN * 1000, "not until it seemed gone silent"
    assert len(rotation._readers) == 1, "the ones unseen for a minute are forgotten"
