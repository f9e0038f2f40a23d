"""What systemd is told each turn (`views.Reporting`), against a notifier that drops datagrams."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_reloader.service.views import Reporting


class Dropping:
    """A notifier whose systemd takes nothing until `taking` is set (its queue full)."""

    enabled = True

    def __init__(self, watchdog_interval: float | None = None) -> None:
        self.watchdog_interval = watchdog_interval
        self.taking = False
        self.sent: list[str] = []

    def _send(self, what: str) -> bool:
        self.sent.append(what)
        return self.taking

    def ready(self, status: str | None = None) -> bool:
        return self._send(f"READY {status}")

    def status(self, text: str) -> bool:
        return self._send(f"STATUS {text}")

    def watchdog(self) -> bool:
        return self._send("WATCHDOG")

    def extend_timeout(self, seconds: float) -> bool:
        return self._send("EXTEND")


def reloader(ready: bool) -> SimpleNamespace:
    canary = object()
    engines = SimpleNamespace(canary=canary, idle=lambda engine: ready and engine is canary)
    return SimpleNamespace(served=SimpleNamespace(reconciled=ready), engines=engines)


CONFIG = SimpleNamespace(engine=SimpleNamespace(retry_max=2.0))


def test_reporting_a_ready_systemd_dropped_is_owed_even_when_the_status_line_then_got_through():
    notifier = Dropping()
    reporting = Reporting(notifier)
    reporting._tell(CONFIG, reloader(ready=True), "serving step-1", healthy=True)
    assert notifier.sent[0] == "READY serving step-1" and not reporting.ready_sent
    assert reporting.resend_at is not None, "the loop is woken to send it again"
    notifier.taking = True
    reporting.resend_at = None
    reporting._tell(CONFIG, reloader(ready=True), "serving step-1", healthy=True)
    assert reporting.ready_sent and notifier.sent.count("READY serving step-1") == 2
    assert reporting.resend_at is None


def test_reporting_pings_a_short_watchdog_at_least_twice_per_its_interval(monkeypatch):
    """WatchdogSec=1 (interval 0.5 s): a ping a second would let systemd kill the daemon."""
    clock = [100.0]
    monkeypatch.setattr("vllm_reloader.service.views.time.monotonic", lambda: clock[0])
    notifier = Dropping(watchdog_interval=0.5)
    notifier.taking = True
    reporting = Reporting(notifier)
    reporting.ready_sent = True
    for step in range(10):
        clock[0] = 100.0 + step * 0.25
        reporting._tell(CONFIG, reloader(ready=True), "serving step-1", healthy=True)
    assert notifier.sent.count("WATCHDOG") >= 9, notifier.sent  # one each 0.25 s, not each second
