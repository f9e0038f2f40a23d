"""Which engines should take traffic, for the load balancer in front of them.

`GET /ready/<n>` (n: the engine's place in `engine.urls`, from 0) answers 200 while engine n
should take traffic and 503, with why, while it should not: not answering yet or down, or
out of rotation for a reload (`[readiness] drain`: taken out before its pause, back only
after its canary passed or its rollback). HAProxy's `option httpchk GET /ready/0`, Envoy's
health checks and a Kubernetes readiness probe all read it.

`Rotation` is written by the loop (an engine up or down) and by the engines' reload threads
(drain), and read by the server's threads; one lock, no I/O under it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer

from ..errors import ConfigError
from .bounded import Bounded

NOT_YET = "not reconciled yet"
WATCHED_WITHIN = 5.0
"""Seconds: a drain waits for the balancer's checks where one read an engine this recently
(or within twice the grace, for slow checkers such as Kubernetes' 10 s probes)."""
MAX_CLIENTS = 32


class Rotation:
    def __init__(self, urls: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self.urls: tuple[str, ...] = ()
        self._out: dict[str, dict[str, str]] = {}
        """url → why it is out, by cause ("down", "drain"): ready when there is none."""
        self._asked: dict[str, tuple[float, bool]] = {}
        """url → when a health check last read it (monotonic), and whether it read "ready":
        what the balancer last saw, where one reads it."""
        self.track(urls)

    def track(self, urls: Sequence[str]) -> None:
        """The engines now (a SIGHUP may change them): new ones are out until reconciled."""
        with self._lock:
            self._out = {url: self._out.get(url, {"down": NOT_YET}) for url in urls}
            self.urls = tuple(urls)

    def take_out(self, url: str, cause: str, why: str) -> None:
        with self._lock:
            self._out.setdefault(url, {})[cause] = why

    def put_back(self, url: str, cause: str) -> None:
        with self._lock:
            self._out.get(url, {}).pop(cause, None)

    def others_ready(self, url: str, *, seen: bool = False) -> bool:
        """Whether another engine takes traffic now (else taking this one out leaves none);
        `seen`: and the balancer's last check of it read it ready (one just put back takes no
        traffic until a check has seen it back)."""
        with self._lock:
            return any(
                self._why(other) is None and (not seen or self._asked.get(other, (0.0, True))[1])
                for other in self.urls
                if other != url
            )

    def why_out(self, url: str) -> str | None:
        """None when the engine should take traffic."""
        with self._lock:
            return self._why(url)

    def _why(self, url: str) -> str | None:
        found = self._out.get(url, {})
        return "; ".join(f"{cause}: {why}" for cause, why in sorted(found.items())) or None

    def asked(self, url: str) -> str | None:
        """A health check reads it: `why_out`, and when it was read."""
        with self._lock:
            why = self._why(url)
            self._asked[url] = (time.monotonic(), why is None)
            return why

    def unseen_since(self, url: str, since: float) -> bool:
        """Whether health checks read this engine before `since` and none has since: the
        balancer has not seen what changed then. False when none ever did (nothing to wait for)."""
        with self._lock:
            return url in self._asked and self._asked[url][0] < since

    def watched(self, within: float) -> bool:
        """Whether a balancer checks these engines: one was read in the last `within` seconds
        (an operator's one `curl` long ago is no balancer to wait for)."""
        with self._lock:
            return any(at >= time.monotonic() - within for at, _ in self._asked.values())


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
        """Once another engine takes traffic as the balancer sees it (else, after `timeout`, the
        reload goes on in place: `drained` false), take it out, wait `grace` and, where a
        balancer checks the engines, until one has read it out, then until nothing is in
        flight at two reads 0.5 s apart (all within `grace + timeout`); None when
        the daemon began stopping meanwhile (then nothing is paused: the caller puts it back).
        It comes back when the loop has seen the reload end on verified weights
        (`Engine.rotate`), not here."""
        begun = time.monotonic()
        watched = self.rotation.watched(max(2 * self.grace, WATCHED_WITHIN))
        while not self.rotation.others_ready(url, seen=watched):  # one back, not seen back yet
            if time.monotonic() > begun + self.timeout:  # never seen: in place, not none serving
                return {"drain_ms": _ms_since(begun), "in_flight_at_pause": None, "drained": False}
            if self.stop.wait(0.02):
                return None
        started = time.monotonic()
        self.rotation.take_out(url, "drain", "out of rotation for a reload")
        if self.stop.wait(self.grace):
            return None
        deadline = started + self.grace + self.timeout
        while watched and self.rotation.unseen_since(url, started) and time.monotonic() < deadline:
            if self.stop.wait(0.02):  # a check slower than the grace (a loaded host): wait for it
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


class _Handler(BaseHTTPRequestHandler):
    rotation: Rotation
    timeout = 5  # seconds for a client to send its request

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        head, _, index = self.path.partition("?")[0].removeprefix("/ready/").partition("/")
        urls = self.rotation.urls
        if (
            not self.path.startswith("/ready/")
            or index
            or not (head.isascii() and head.isdigit() and len(head) < 6)
            or int(head) >= len(urls)
        ):
            self._answer(404, f"no such engine: GET /ready/N, N from 0 to {len(urls) - 1}\n")
            return
        why = self.rotation.asked(urls[int(head)])
        self._answer(200, "ready\n") if why is None else self._answer(503, f"{why}\n")

    def _answer(self, status: int, text: str) -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Health checks every second would flood the log: said nowhere."""
