"""sd_notify over a real AF_UNIX datagram socket, both address kinds."""

import os
import socket
import uuid

import pytest

from vllm_reloader.service.notify import Notifier


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
        sock.bind(address)
    else:
        name = f"vllm-reloader-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        address = "@" + name
    sock.settimeout(5)
    yield sock, address
    sock.close()


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_notify_ready_with_status_arrives_as_one_datagram(listener):
    sock, address = listener
    assert Notifier(address).ready("serving step-1")
    assert received(sock) == ["READY=1", "STATUS=serving step-1"]


def test_notify_reloading_carries_monotonic_time(listener):
    sock, address = listener
    Notifier(address).reloading()
    fields = received(sock)
    assert fields[0] == "RELOADING=1"
    assert fields[1].startswith("MONOTONIC_USEC=") and int(fields[1].split("=")[1]) > 0


def test_notify_watchdog_stopping_and_extend(listener):
    sock, address = listener
    notifier = Notifier(address)
    notifier.watchdog()
    notifier.stopping()
    notifier.extend_timeout(1.5)
    expected = [["WATCHDOG=1"], ["STOPPING=1"], ["EXTEND_TIMEOUT_USEC=1500000"]]
    assert [received(sock) for _ in range(3)] == expected


def test_notify_does_nothing_outside_systemd(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled and not notifier.ready()


def test_notify_watchdog_interval_is_half_of_watchdog_usec(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert Notifier("@x").watchdog_interval == 5.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert Notifier("@x").watchdog_interval is None


def test_notify_never_blocks_when_the_reader_lags(listener):
    _sock, address = listener
    notifier = Notifier(address)
    results = [notifier.status(f"line {i}") for i in range(500)]  # nobody reads: queue fills
    assert results[0] is True and results[-1] is False


def test_notify_to_a_socket_that_is_not_there_is_not_worth_sending_again(tmp_path):
    """Retried every half second forever, it would keep the loop turning for nothing."""
    assert Notifier(str(tmp_path / "gone.sock")).status("serving step-1") is True
