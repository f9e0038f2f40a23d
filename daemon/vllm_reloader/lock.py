"""One daemon per state directory: the lock its record store takes before it reads anything.

A second daemon on the same state (a second `run` by mistake) would replace the first's
control socket, write the same records and drive the same engine; it exits 2 instead,
naming the first's pid.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from .errors import AlreadyRunning, StateError

LOCK_NAME = "lock"
"""Held by the one daemon that owns the state directory, with its pid inside."""


def take_lock(directory: Path) -> int:
    """The state directory's lock, with this process's pid written in it. `AlreadyRunning`,
    naming the holder's pid, when another daemon holds it; `StateError` when it cannot be made.
    A POSIX record lock (`lockf`), so it is the process's: a second store opened in the same
    process (a test reading what its daemon wrote) shares it, and the kernel drops it when the
    process dies however it dies."""
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise StateError(f"cannot open {path}: {exc.strerror or exc}") from exc
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        except OSError:
            holder = "unknown"
        finally:
            os.close(fd)
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise StateError(f"cannot lock {path}: {exc.strerror or exc}") from exc
        raise AlreadyRunning(
            f"another vllm-reloader (pid {holder}) runs with state dir {directory}: one daemon per "
            "state dir (stop that one first, e.g. `systemctl stop vllm-reloader`, or give this one "
            "its own [state] dir)"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # the lock holds all the same; only the pid a second daemon names is missing
    return fd
