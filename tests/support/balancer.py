"""A real HAProxy in front of real engines, health-checking the daemon's readiness endpoint,
and clients that record which engine answered what and when, next to samplers of what each
engine (`/is_paused`) and the balancer (its stats socket) said at each moment. Used by the
zero-exposure test (tests/e2e/test_e2e_balancer.py) and its benchmark (bench/drain.py)."""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import background
from tests.support.engine_fixtures import API_KEY, Engine
from tests.support.ports import unused_port
from vllm_reloader.tools.demo import stop_process

CHECK_INTERVAL = 0.1
"""Seconds between HAProxy's health checks of each engine (`inter`): a drain's `grace` must
be at least this (plus the check's own time)."""
PROMPT = "w1 w2 w3"
MAX_TOKENS = 4


@dataclass(frozen=True)
class Sample:
    """What a peer said when asked: it held at some moment from `asked` to `answered` (a busy
    engine answers late, so neither moment alone is when it held)."""

    asked: float
    answered: float
    value: Any


Samples = dict[str, list[Sample]]
"""Engine (its place in `engine.urls`) → whether it said it was paused, in time order."""
States = list[Sample]
"""HAProxy's state of each server (`UP`, `DOWN`, ...) by name, in time order."""


def haproxy_config(listen: int, engines: Sequence[str], readiness_port: int, stats: Path) -> str:
    """What docs/operations.md tells operators to write: one server per engine, named by its
    place in `engine.urls`, health-checked at `/ready/<that place>` on the daemon's port."""
    servers = "".join(
        f"  server {i} {url.removeprefix('http://')} check addr 127.0.0.1 port {readiness_port}\n"
        for i, url in enumerate(engines)
    )
    return (
        f"global\n  stats socket {stats} mode 600 level user\n"
        "defaults\n  mode http\n  timeout connect 5s\n  timeout check 10s\n"
        "  timeout client 10m\n  timeout server 10m\n"
        f"frontend api\n  bind 127.0.0.1:{listen}\n  default_backend engines\n"
        "backend engines\n  balance roundrobin\n  option httpchk\n"
        # vLLM (uvicorn) closes a connection idle for 5 s; an engine out of rotation for a reload
        # idles longer, and HAProxy reusing such a connection just as it closes drops the client's
        # request without an answer ("Server disconnected"): retry it on another connection.
        # HAProxy retries only a request it had whole before sending it (httpx writes the
        # headers and the body apart): wait for the body first.
        "  retry-on conn-failure empty-response\n  retries 3\n  option http-buffer-request\n"
        "  http-check send meth GET uri-lf /ready/%[srv_name]\n  http-check expect status 200\n"
        f"  default-server inter {int(CHECK_INTERVAL * 1000)}ms fall 1 rise 1\n"
        "  http-response set-header X-Served-By %[srv_name]\n"
        # When it is passed on (the body in): the tests' clock for "sent into a pause".
        "  http-request set-var(txn.passed_on) date(0,ms)\n"
        "  http-response set-header X-Passed-On %[var(txn.passed_on)]\n" + servers
    )


@dataclass
class Balancer:
    url: str
    process: subprocess.Popen[bytes]
    stats: Path
    log: Path

    def servers(self) -> dict[str, str]:
        """Each server's state as HAProxy has it now (`UP`, `DOWN`, ...), by name."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.stats))
            sock.sendall(b"show stat\n")
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        found = {}
        for line in raw.decode().splitlines():
            fields = line.split(",")
            if len(fields) > 17 and fields[0] == "engines" and fields[1] not in ("FRONTEND", "BACKEND"):
                found[fields[1]] = fields[17]
        return found

    def wait_all_up(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while (states := self.servers()) != {str(i): "UP" for i in range(count)}:
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, f"not every engine is up in HAProxy: {states}"
            time.sleep(0.05)

    def stop(self) -> None:
        stop_process(self.process)


def start_haproxy(engines: Sequence[str], readiness_port: int, directory: Path) -> Balancer:
    """HAProxy (Debian's `haproxy`; scripts/test installs it) in the foreground, as a child."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
    if found is None:
        pytest.fail("haproxy is missing: scripts/test installs it (apt-get install haproxy)")
    directory.mkdir(parents=True, exist_ok=True)
    port, stats, config, log = (
        unused_port(),
        directory / "stats.sock",
        directory / "haproxy.cfg",
        directory / "haproxy.log",
    )
    config.write_text(haproxy_config(port, engines, readiness_port, stats))
    with log.open("wb") as out:
        process = subprocess.Popen(
            [found, "-db", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    balancer = Balancer(f"http://127.0.0.1:{port}", process, stats, log)
    deadline = time.monotonic() + 30
    while not stats.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            balancer.stop()
            pytest.fail(f"HAProxy did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return balancer


@dataclass(frozen=True)
class Answer:
    """One client request through the balancer."""

    sent: float
    done: float
    server: str | None
    """Which engine answered (its place in `engine.urls`, HAProxy's `X-Served-By`)."""
    status: int | None
    text: str | None
    error: str | None = None
    passed_on: float | None = None
    """When HAProxy passed it to the engine, once it had it whole (`X-Passed-On`): a client
    starved of CPU between its headers and its body sends it seconds after `sent`."""

    @property
    def seconds(self) -> float:
        return self.done - self.sent


class Clients:
    """`count` clients sending greedy completions through the balancer back to back; one
    sampler asking each engine `/is_paused` and HAProxy for its servers' states, in a loop."""

    def __init__(self, balancer: Balancer, engines: Sequence[Engine], count: int = 3) -> None:
        self.balancer, self.engines = balancer, list(engines)
        self.stop = threading.Event()
        self.answers: list[Answer] = []
        self.paused: Samples = {str(i): [] for i in range(len(engines))}
        self.states: States = []
        self.errors: list[str] = []
        """What the sampler could not ask (it goes on)."""
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(count)]
        samplers: list[tuple[Callable[[], object], list[Sample]]] = [
            (lambda e=e: bool(e.http.get("/is_paused", timeout=1).json()["is_paused"]), self.paused[str(i)])
            for i, e in enumerate(self.engines)
        ]
        samplers.append((balancer.servers, self.states))  # each on its own: one slow peer holds no other
        self.threads += [threading.Thread(target=self._sample, args=s, daemon=True) for s in samplers]

    def _client(self) -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        with httpx.Client(
            base_url=self.balancer.url, timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}
        ) as http:
            while not self.stop.is_set():
                sent = time.time()
                try:
                    response = http.post("/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    self.answers.append(Answer(sent, time.time(), None, None, None, repr(exc)))
                    continue
                text = response.json()["choices"][0]["text"] if response.status_code == 200 else None
                error = None if response.status_code == 200 else response.text[:200]
                server, passed_on = response.headers.get("X-Served-By"), response.headers.get("X-Passed-On")
                at = int(passed_on) / 1000 if passed_on else None
                self.answers.append(Answer(sent, time.time(), server, response.status_code, text, error, at))

    def _sample(self, ask: Callable[[], object], into: list[Sample]) -> None:
        """Never ends on an error (a busy engine slow to answer): it asks again at once."""
        while not self.stop.wait(0.01):
            try:
                asked = time.time()
                into.append(Sample(asked, time.time(), ask()))
            except (OSError, httpx.HTTPError, ValueError) as exc:
                self.errors.append(repr(exc))

    @contextmanager
    def running(self) -> Iterator[Clients]:
        with background.running(self.threads, self.stop, join_s=300):
            yield self


@dataclass(frozen=True)
class Pause:
    """An engine seen paused, surely from `since` to `until` (between its first and last
    paused answers), and surely running again by `resumed`."""

    since: float
    until: float
    resumed: float


def pauses(samples: list[Sample]) -> list[Pause]:
    found, run = [], []
    for sample in samples:
        if sample.value:
            run.append(sample)
        elif run:
            found.append(Pause(run[0].answered, run[-1].asked, sample.answered))
            run = []
    return found + ([Pause(run[0].answered, run[-1].asked, math.inf)] if run else [])


DISPATCH_LAG = 0.5
"""Margin between the moment HAProxy says it passed a request on (`X-Passed-On`) and the
samplers' reads of the engine, on a loaded 2-core machine. The pauses these tests hold last
2.5 s, so a request routed into one is still caught. (The client's own send time is no clock
for this: seen in CI, a client starved between its headers and its body sent it 3.6 s late.)"""


def held_through_a_pause(answers: Sequence[Answer], paused: Samples) -> list[Answer]:
    """Answers sent before a moment their engine was surely paused (`DISPATCH_LAG` before its
    last paused answer) and given only once it surely ran again: the client waited through the
    pause (and got the weights after it). What was in flight when a drained engine paused
    (vLLM's `wait` mode) finishes before the reload: not held."""
    windows = {server: pauses(samples) for server, samples in paused.items()}
    return [
        a
        for a in answers
        if any(
            (a.passed_on or a.sent) < p.until - DISPATCH_LAG and a.done > p.resumed
            for p in windows.get(a.server or "", [])
        )
    ]


def paused_in_rotation(paused: Samples, states: States) -> list[tuple[str, float]]:
    """Moments HAProxy said an engine was UP (taking traffic) while it was surely paused."""
    found = []
    for server, samples in paused.items():
        for p in pauses(samples):
            found += [
                (server, s.asked)
                for s in states
                if p.since <= s.asked and s.answered <= p.until and s.value.get(server) == "UP"
            ]
    return found


def tail(answers: Sequence[Answer]) -> dict[str, float | int]:
    """Latency of answered requests: p50, p99, max (ms), and how many."""
    seconds = sorted(a.seconds for a in answers if a.status == 200)
    if not seconds:
        return {"requests": 0}
    at = lambda q: seconds[min(len(seconds) - 1, round(q * (len(seconds) - 1)))]  # noqa: E731
    return {
        "requests": len(seconds),
        "p50_ms": round(at(0.5) * 1000, 1),
        "p99_ms": round(at(0.99) * 1000, 1),
        "max_ms": round(seconds[-1] * 1000, 1),
    }
