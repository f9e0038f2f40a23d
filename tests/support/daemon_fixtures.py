"""The daemon in this process, on a real filesystem and watcher, against the scripted engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import structlog

from tests.support.fake_engine import FakeEngine
from vllm_reloader import config
from vllm_reloader.service.daemon import Daemon

ENGINE_URL = "http://engine.test"


def follower_url(index: int) -> str:
    return f"http://engine{index + 2}.test"


class Running:
    def __init__(self, daemon: Daemon, logs: list[dict], thread: threading.Thread | None = None) -> None:
        self.daemon, self.logs, self.thread = daemon, logs, thread

    def stop(self) -> None:
        """SIGTERM, as systemd sends it, and wait until the daemon stopped."""
        self.daemon.request_stop()
        if self.thread is not None:
            self.thread.join(timeout=10)
            assert not self.thread.is_alive()

    def events(self, event: str, /, **fields: object) -> list[dict]:
        return events_in(self.logs, event, **fields)

    def wait_for(self, event: str, /, timeout: float = 10.0, **fields: object) -> dict:
        return wait_for_event(self.logs, event, timeout, **fields)


def events_in(logs: list[dict], event: str, /, **fields: object) -> list[dict]:
    """The captured events named `event` that carry `fields`."""
    return [e for e in list(logs) if e["event"] == event and fields.items() <= e.items()]


def wait_for_event(logs: list[dict], event: str, timeout: float = 10.0, /, **fields: object) -> dict:
    """The newest such event once one was logged; AssertionError (naming what was) after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := events_in(logs, event, **fields):
            return found[-1]
        time.sleep(0.02)
    raise AssertionError(f"no {event} {fields} in {[e['event'] for e in logs]}")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


@pytest.fixture
def start(tmp_path: Path, root: Path) -> Iterator[Callable[..., Running]]:
    threads: list[tuple[Daemon, threading.Thread]] = []
    (tmp_path / "state").mkdir()  # as an operator would (the daemon never makes it); a test may fill it

    def run(
        engine: FakeEngine,
        engine_check_interval: float = 5.0,
        canary: config.CanaryConfig | None = None,
        baseline: Path | None = None,
        followers: Sequence[FakeEngine | str] = (),
        max_unavailable: int = 1,
        timeout: float = 10.0,
        readiness: config.ReadinessConfig | None = None,
        adapters: config.AdaptersConfig | None = None,
        gate: config.GateConfig | None = None,
        **source: object,
    ) -> Running:
        """`followers`: more engines on the host, at `follower_url(i)`; a URL (a real socket, such
        as `FakeEngineServer`'s) is reached by the daemon's own client."""
        urls = [
            ENGINE_URL,
            *(f if isinstance(f, str) else follower_url(i) for i, f in enumerate(followers)),
        ]
        cfg = config.Config(
            source=config.SourceConfig(path=root, pending_recheck_interval=0.05, **source),  # type: ignore[arg-type]
            engine=config.EngineConfig(
                urls=urls,
                max_unavailable=max_unavailable,
                retry_initial=0.05,
                retry_max=0.2,
                check_interval=engine_check_interval,
                baseline=baseline,
                timeout=timeout,
            ),
            state=config.StateConfig(dir=tmp_path / "state"),
            canary=canary or config.CanaryConfig(),
            readiness=readiness or config.ReadinessConfig(),
            adapters=adapters or config.AdaptersConfig(),
            gate=gate or config.GateConfig(),
        )
        fakes = [engine, *followers]
        clients = {
            url: fake.client(url, retry_initial=0.05)
            for url, fake in zip(urls, fakes, strict=True)
            if not isinstance(fake, str)
        }
        daemon = Daemon(cfg, clients=clients)
        thread = threading.Thread(target=daemon.run, daemon=True)
        threads.append((daemon, thread))
        thread.start()
        return Running(daemon, logs, thread)

    with structlog.testing.capture_logs() as logs:
        yield run
        for daemon, thread in threads:
            daemon.request_stop()
            thread.join(timeout=10)
            assert not thread.is_alive()
