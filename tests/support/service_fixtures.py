"""The daemon as systemd runs it, against the scripted engine behind a real HTTP socket:
a real subprocess, a real NOTIFY_SOCKET, real signals."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.checkpoints import MakeCheckpoint
from tests.support.engine_fixtures import DaemonProcess, daemon_config
from tests.support.fake_engine import FakeEngine, FakeEngineServer


class NotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[list[str]] = []

    def wait_for(self, field: str, timeout: float = 20.0) -> list[str]:
        """The first datagram not yet consumed that holds `field` (KEY=value or KEY=)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                fields = self.sock.recv(65536).decode().split("\n")
            except TimeoutError:
                continue
            self.messages.append(fields)
            if any(f == field or (field.endswith("=") and f.startswith(field)) for f in fields):
                return fields
        raise AssertionError(f"no {field} in {self.messages}")

    def fill(self) -> int:
        """systemd reading late: its queue full (10 datagrams by default), the next one dropped."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK) as filler:
            queued = 0
            while True:
                try:
                    filler.sendto(b"STATUS=stale", str(self.path))
                except BlockingIOError:
                    return queued
                queued += 1

    def drain(self) -> list[list[str]]:
        """Everything queued now, read at once (systemd catching up)."""
        found = []
        self.sock.setblocking(False)
        try:
            while True:
                try:
                    found.append(self.sock.recv(65536).decode().split("\n"))
                except BlockingIOError:
                    return found
        finally:
            self.sock.settimeout(0.2)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def service(tmp_path: Path, make_checkpoint: MakeCheckpoint) -> Iterator[tuple]:
    root = tmp_path / "root"
    make_checkpoint("step-1", step=1, root=root)
    engine = FakeEngine(startup=str(root / "step-1"))
    server = FakeEngineServer(engine)
    notify = NotifySocket(tmp_path / "notify.sock")
    config = daemon_config(
        tmp_path / "daemon.toml", root=root, engine_url=server.url, state_dir=tmp_path / "s"
    )
    started: list[DaemonProcess] = []

    def start(args: tuple[str, ...] = (), **env: str) -> DaemonProcess:
        os.environ.update({"NOTIFY_SOCKET": str(notify.path), **env})
        try:
            daemon = DaemonProcess(config, *args)
        finally:
            for key in ("NOTIFY_SOCKET", *env):
                os.environ.pop(key, None)
        started.append(daemon)
        return daemon

    yield start, engine, notify, config, root
    for daemon in started:
        daemon.stop()
    notify.close()
    server.close()
