"""A small real filesystem that a test can fill up: tmpfs, mounted under the test's tmp_path.

Mounting needs root (or CAP_SYS_ADMIN); where it is refused, `tmpfs` says why and mounts
nothing, so the test can fall back to a simulated disk and say which one it ran on.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

PAGE = 4096
"""tmpfs allocates whole pages: a write that spans two pages with one free is cut short."""


@contextlib.contextmanager
def tmpfs(directory: Path, size: int) -> Iterator[str]:
    """Mounts `size` bytes of tmpfs on `directory` for the block; yields "" when it is mounted,
    or why it could not be (then `directory` is a plain directory on the test's disk)."""
    directory.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs", str(directory)]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        stderr = getattr(exc, "stderr", None)
        yield f"{' '.join(command)}: {(stderr or str(exc)).strip()}"
        return
    try:
        yield ""
    finally:
        unmount = subprocess.run(["umount", str(directory)], capture_output=True, timeout=30)
        if unmount.returncode != 0:  # busy: a file left open under it; detach it all the same
            subprocess.run(["umount", "-l", str(directory)], check=True, timeout=30)


def fill(directory: Path, *, leave: int = 0) -> Path:
    """Another writer takes every free byte of `directory`'s filesystem but `leave` (whole pages)."""
    filler = directory / "filler"
    block = b"\xff" * PAGE
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            try:
                if os.write(fd, block) < len(block):
                    break
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        size = os.fstat(fd).st_size
        os.ftruncate(fd, max(0, size - size % PAGE - leave))
    finally:
        os.close(fd)
    return filler


def open_under(directory: Path) -> list[str]:
    """The files this process holds open under `directory` (by /proc/self/fd)."""
    found = []
    for entry in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd, closed by now
            target = os.readlink(f"/proc/self/fd/{entry}")
            if target.startswith(f"{directory}/"):
                found.append(target)
    return found
