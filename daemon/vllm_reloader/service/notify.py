"""sd_notify, written directly on the datagram socket.

The PyPI packages for this are unmaintained since 2017 or native builds, and the protocol
is one datagram to `$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace). Without
that variable (not under systemd) every call does nothing.
"""

from __future__ import annotations

import errno
import os
import socket
import time


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self.address = "\0" + address[1:] if address.startswith("@") else address
        watchdog_usec = os.environ.get("WATCHDOG_USEC", "")
        watchdog_pid = os.environ.get("WATCHDOG_PID", "")
        pid_ok = not watchdog_pid or watchdog_pid == str(os.getpid())
        self.watchdog_interval = int(watchdog_usec) / 2e6 if watchdog_usec.isdigit() and pid_ok else None
        """Half of WatchdogSec, in seconds, as sd_watchdog_enabled() advises; None when off."""

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *fields: str) -> bool:
        """Send `KEY=value` lines in one datagram; False when not under systemd or when systemd
        did not take it now (its queue full: worth sending again). A socket that is not there
        or refuses is no reason to send again: True."""
        if not self.address:
            return False
        # Non-blocking: a unix datagram socket whose reader lags blocks the sender once its
        # queue is full, and a wedged main loop would be worse than a dropped STATUS line.
        with socket.socket(
            socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        ) as sock:
            try:
                sock.sendto("\n".join(fields).encode(), self.address)
            except OSError as exc:  # systemd's queue full: again soon; no such socket, refused:
                return exc.errno not in (errno.EAGAIN, errno.ENOBUFS, errno.EINTR)  # again helps nothing
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        return self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")
