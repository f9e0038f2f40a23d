"""Threads a test runs beside what it drives (clients, samplers), started and stopped together."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


@contextmanager
def running(threads: Sequence[threading.Thread], stop: threading.Event, join_s: float) -> Iterator[None]:
    """Start them; at the end set `stop` and wait up to `join_s` for each."""
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=join_s)
