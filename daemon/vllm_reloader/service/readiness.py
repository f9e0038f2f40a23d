"""Which engines should take traffic, for the load balancer in front of them.

`GET /ready/<n>` (n: the engine's place in `engine.urls`, from 0, or its HOST:PORT, which a
SIGHUP that reorders `urls` does not move) answers 200 while engine n
should take traffic and 503, with why, while it should not: not answering yet or down, or
out of rotation for a reload (`[readiness] drain`: taken out before its pause, back only
after its canary passed or its rollback). HAProxy's `option httpchk GET /ready/0`, Envoy's
health checks and a Kubernetes readiness probe all read it.

`Rotation` is written by the engines' schedulers: on the loop by their one rule (`settle`),
and by a drain on an engine's thread (out before its pause); the server's threads read it. One
lock, no I/O under it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import urlsplit

from ..config import Config
from ..errors import ConfigError
from .bounded import Bounded

NOT_YET = "not reconciled yet"
WATCHED_WITHIN = 5.0
"""Seconds: a drain waits for the balancer's checks where one read an engine this recently
(or within twice the grace, for slow checkers such as Kubernetes' 10 s probes)."""
MAX_CLIENTS = 32
MAX_READERS = 64
"""Health checkers remembered (by address): a scan from many addresses cannot grow it."""
READER_TTL = 60.0
"""Seconds: a health checker unseen this long is forgotten (a balancer replaced, a scan gone),
so its place goes to the next one."""
REQUEST_DEADLINE = 5.0
"""Seconds for a client to send its whole request, however slowly its bytes come: a client
trickling a byte a second holds a slot this long at most."""


@dataclass(frozen=True)
class _Read:
    """A health checker's last read of an engine, and how many before it said the same."""

    at: float
    """When (monotonic)."""
    ready: bool
    in_a_row: int
    """How many of its reads of it in a row, this one included, said the same."""

    @property
    def taken_in(self) -> bool:
        """Read again since the read before said the same: a checker asks again only once it
        has taken in its last answer, so the balancer acts on it now (one answer alone may still
        be on its way: a slow check on a busy host takes most of a second)."""
        return self.in_a_row >= 2

    def then(self, at: float, ready: bool) -> _Read:
        return _Read(at, ready, self.in_a_row + 1 if ready == self.ready else 1)


class Rotation:
    def __init__(self, urls: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self.urls: tuple[str, ...] = ()
        self._out: dict[str, dict[str, str]] = {}
        """url → why it is out, by cause ("down", "drain"): ready when there is none."""
        self._reads: dict[tuple[str, str], _Read] = {}
        """(reader, url) → that health checker's last read of it: what each balancer last saw
        (a pair of HAProxies: two readers)."""
        self._readers: dict[str, float] = {}
        """reader → when it last read any engine: one silent for long is gone."""
        self.track(urls)

    def track(self, urls: Sequence[str]) -> None:
        """The engines now (a SIGHUP may change them): new ones are out until reconciled."""
        with self._lock:
            self._out = {url: self._out[url] if url in self.urls else {"down": NOT_YET} for url in urls}
            self._reads = {key: read for key, read in self._reads.items() if key[1] in urls}
            self.urls = tuple(urls)

    def take_out(self, url: str, cause: str, why: str) -> None:
        with self._lock:
            if url in self._out:  # not one a SIGHUP dropped
                self._out[url][cause] = why

    def take_out_if_others_ready(self, url: str, cause: str, why: str, seen_within: float | None) -> bool:
        """Take it out only while another engine takes traffic (checked and done at once: two
        drains never both see the other ready and both go)."""
        with self._lock:
            if not self._others_ready(url, seen_within):
                return False
            if url in self._out:
                self._out[url][cause] = why
            return True

    def settle(self, url: str, causes: Mapping[str, str], *, drained: bool) -> None:
        """Why `url` is out now, whole (the scheduler's one rule): a drain under way stays
        (`drained`), one whose work ended goes."""
        with self._lock:
            if url not in self._out:  # one a SIGHUP dropped
                return
            drain = self._out[url].get("drain") if drained else None
            self._out[url] = {**causes, **({"drain": drain} if drain is not None else {})}

    def put_back(self, url: str, cause: str) -> None:
        with self._lock:
            self._out.get(url, {}).pop(cause, None)

    def others_ready(self, url: str, *, seen_within: float | None = None) -> bool:
        """Whether another engine takes traffic now (else taking this one out leaves none);
        `seen_within`: and every health checker that read it in the last so many seconds has
        seen it back (one just put back takes no traffic until they have)."""
        with self._lock:
            return self._others_ready(url, seen_within)

    def _others_ready(self, url: str, seen_within: float | None) -> bool:
        def seen_ready(other: str) -> bool:
            reads = self._recent(other, seen_within) if seen_within is not None else []
            return all(read.ready and read.taken_in for read in reads)

        return any(self._why(o) is None and seen_ready(o) for o in self.urls if o != url)

    def _recent(self, url: str, within: float) -> list[_Read]:
        """The last read of `url` by each checker that read any engine in the last `within` s."""
        now = time.monotonic()
        return [
            read
            for (reader, read_url), read in self._reads.items()
            if read_url == url and self._readers.get(reader, 0.0) >= now - within
        ]

    def why_out(self, url: str) -> str | None:
        """None when the engine should take traffic."""
        with self._lock:
            return self._why(url)

    def _why(self, url: str) -> str | None:
        found = self._out.get(url, {})
        return "; ".join(f"{cause}: {why}" for cause, why in sorted(found.items())) or None

    def asked(self, url: str, reader: str = "") -> str | None:
        """A health checker (`reader`: its address) reads it: `why_out`, and what it read when."""
        with self._lock:
            why, now = self._why(url), time.monotonic()
            self._forget_readers(now)
            if url in self._out and (reader in self._readers or len(self._readers) < MAX_READERS):
                last = self._reads.get((reader, url))
                ready = why is None
                self._reads[reader, url] = last.then(now, ready) if last else _Read(now, ready, 1)
                self._readers[reader] = now
            return why

    def _forget_readers(self, now: float) -> None:
        """Health checkers unseen for `READER_TTL`, and what they read."""
        gone = {reader for reader, at in self._readers.items() if at < now - READER_TTL}
        if gone:
            self._readers = {r: at for r, at in self._readers.items() if r not in gone}
            self._reads = {key: read for key, read in self._reads.items() if key[0] not in gone}

    def unseen_since(self, url: str, since: float, within: float) -> bool:
        """Whether a health checker that reads these engines (one read in the last `within` s)
        has not read this one out since `since` and taken that in: that balancer may still send
        it traffic."""
        with self._lock:
            reads = self._recent(url, within)
            return any(read.at < since or read.ready or not read.taken_in for read in reads)

    def watched(self, within: float) -> bool:
        """Whether a balancer checks these engines: one was read in the last `within` seconds
        (an operator's one `curl` long ago is no balancer to wait for)."""
        with self._lock:
            return any(at >= time.monotonic() - within for at in self._readers.values())


@dataclass(frozen=True)
class Drain:
    """How a reload thread takes its engine out of rotation and waits for it to empty."""

    rotation: Rotation
    grace: float
    """Seconds for the balancer to see the engine not ready (at least its check interval)."""
    timeout: float
    """At most this long for the requests in flight to finish."""
    stop: threading.Event

    def out(self, url: str, in_flight: Callable[[], int | None]) -> dict[str, float | int | None] | None:
        """Once another engine takes traffic as the balancers see it (else, after `timeout`, the
        reload goes on in place: `drained` false), take it out, wait `grace` and, where
        balancers check the engines, until each has read it out, then until nothing is in
        flight at two reads 0.5 s apart (all within `grace + timeout`); None when
        the daemon began stopping meanwhile (then nothing is paused: the caller puts it back).
        It comes back when the loop has seen the reload end on verified weights
        (`Engine.rotate`), not here."""
        begun = time.monotonic()
        deadline = begun + self.grace + self.timeout
        window = max(2 * self.grace, WATCHED_WITHIN)
        seen_within = window if self.rotation.watched(window) else None
        why = "out of rotation for a reload"
        while not self.rotation.take_out_if_others_ready(url, "drain", why, seen_within):
            if time.monotonic() > begun + self.timeout:  # none seen back: in place, not none serving
                return {"drain_ms": _ms_since(begun), "in_flight_at_pause": None, "drained": False}
            if self.stop.wait(0.02):  # the one before is back, not seen back by the balancer yet
                return None
        started = time.monotonic()
        if self.stop.wait(self.grace):
            return None
        while seen_within and self.rotation.unseen_since(url, started, seen_within):
            if time.monotonic() >= deadline or self.stop.wait(0.02):  # a check slower than the grace
                break
        if self.stop.is_set():
            return None
        quiet = 0  # reads in a row with nothing in flight: one request may be in vLLM's HTTP
        while (left := in_flight()) is not None:  # layer still, not counted yet; the next shows it
            quiet = quiet + 1 if left == 0 else 0
            if quiet == 2 or time.monotonic() >= deadline:
                break
            if self.stop.wait(0.5):
                return None
        return {"drain_ms": _ms_since(begun), "in_flight_at_pause": left}


def _ms_since(started: float) -> float:
    return round((time.monotonic() - started) * 1000, 3)


def serve(whole: Config, rotation: Rotation, log: Any) -> ReadinessServer | None:
    """`GET /ready/<n>` for the balancer, where `[readiness] listen` says (read at start only)."""
    config = whole.readiness
    if config.listen is None:
        return None
    server = ReadinessServer(config.listen, rotation)
    server.start()
    in_place = config.drain and len(whole.engine.urls) < 2
    log.info(
        "readiness.listening",
        listen=config.listen,
        engines={str(n): url for n, url in enumerate(whole.engine.urls)},
        drain="in place: one engine alone" if in_place else "rotation" if config.drain else "off",
    )
    return server


class ReadinessServer:
    """`GET /ready/<n>` on `listen` (HOST:PORT), in threads of its own."""

    def __init__(self, listen: str, rotation: Rotation) -> None:
        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        handler = type("Handler", (_Handler,), {"rotation": rotation})
        server = _Server6 if ":" in host else _Server
        try:
            self.server = server((host, int(port)), handler)
        except OSError as exc:
            raise ConfigError(f"readiness.listen {listen}: cannot listen: {exc.strerror or exc}") from exc
        self.thread = threading.Thread(target=self.server.serve_forever, name="readiness", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(Bounded, HTTPServer):
    def limit(self) -> int:
        return MAX_CLIENTS


class _Server6(_Server):
    address_family = socket.AF_INET6


def engine_named(name: str, urls: Sequence[str]) -> str | None:
    """The engine `/ready/<name>` asks about: its place in `urls` (from 0), or its address as
    the URL gives it (`127.0.0.1:8001`), which a SIGHUP that reorders `urls` does not move."""
    if name.isascii() and name.isdigit() and len(name) < 6:
        return urls[int(name)] if int(name) < len(urls) else None
    found = [url for url in urls if name and urlsplit(url).netloc.lower() == name.lower()]
    return found[0] if len(found) == 1 else None  # two at one address (other paths): say neither


class _DeadlineReader:
    """The request's bytes, read with one deadline for the whole request (a timeout per read
    would let a client sending a byte a second hold its slot for ever)."""

    def __init__(self, connection: socket.socket, seconds: float) -> None:
        self.connection, self.deadline, self.buffer = connection, time.monotonic() + seconds, b""

    def readline(self, limit: int = -1) -> bytes:
        while b"\n" not in self.buffer and (limit < 0 or len(self.buffer) < limit):
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request took longer than its deadline")
            self.connection.settimeout(left)
            chunk = self.connection.recv(4096)
            if not chunk:
                break
            self.buffer += chunk
        end = self.buffer.find(b"\n") + 1 or len(self.buffer)
        if limit >= 0:
            end = min(end, limit)
        line, self.buffer = self.buffer[:end], self.buffer[end:]
        return line

    def close(self) -> None:
        """Nothing of its own to close (the server shuts the connection)."""


class _Handler(BaseHTTPRequestHandler):
    rotation: Rotation
    timeout = REQUEST_DEADLINE

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the socket's own file: the request is read through the deadline
        self.rfile = _DeadlineReader(self.connection, REQUEST_DEADLINE)  # type: ignore[assignment]

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        head, _, rest = self.path.partition("?")[0].removeprefix("/ready/").partition("/")
        urls = self.rotation.urls
        url = None if rest or not self.path.startswith("/ready/") else engine_named(head, urls)
        if url is None:
            named = f"N from 0 to {len(urls) - 1}, or /ready/HOST:PORT"
            self._answer(404, f"no such engine: GET /ready/N, {named}\n")
            return
        why = self.rotation.asked(url, str(self.client_address[0]))
        self._answer(200, "ready\n") if why is None else self._answer(503, f"{why}\n")

    def _answer(self, status: int, text: str) -> None:
        self.connection.settimeout(REQUEST_DEADLINE)  # what is left of the read's may be nothing
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Health checks every second would flood the log: said nowhere."""
