"""The one lifecycle of the daemon's threads: `start`, `is_alive`, `close`.

Every thread the loop relies on — the object-store source, the adapter source, the converter,
the gate, the reverifier, each engine's worker — is a `Worker`: one daemon thread, one `stop`
event, and `close` that stops it and waits a bounded time (a thread stuck in a call to a hung
peer is left behind: it dies with the process). The loop checks `is_alive` at every turn and
exits 1 on a dead one, so systemd restarts the daemon rather than running on without it.

Two shapes: a `QueueWorker` handles jobs one at a time in order; a `LoopWorker` looks at
something every `interval` seconds, sooner when woken.
"""

from __future__ import annotations

import queue
import threading
from typing import Generic, TypeVar

J = TypeVar("J")


class Worker:
    def __init__(self, name: str) -> None:
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """Stop, and wait at most `timeout` seconds for what runs now (0: do not wait)."""
        self.stop.set()
        self.wake()
        if timeout > 0 and self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def wake(self) -> None:
        """Interrupt what the thread waits on (so it sees `stop`)."""

    def run(self) -> None:
        raise NotImplementedError


class QueueWorker(Worker, Generic[J]):
    """Handles submitted jobs one at a time, in order, until `close` (or `finish`)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._jobs: queue.SimpleQueue[J | None] = queue.SimpleQueue()

    def submit(self, job: J) -> None:
        self._jobs.put(job)

    def finish(self) -> None:
        """Take no more work: the thread ends after what was submitted before."""
        self._jobs.put(None)

    def wake(self) -> None:
        self._jobs.put(None)

    def run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.handle(job)

    def handle(self, job: J) -> None:
        raise NotImplementedError


class LoopWorker(Worker):
    """Calls `turn` every `interval` seconds, or as soon as `poke` is called."""

    def __init__(self, name: str, interval: float) -> None:
        super().__init__(name)
        self.interval = interval
        self._poked = threading.Event()

    def poke(self) -> None:
        """Look now rather than at the next interval."""
        self._poked.set()

    def wake(self) -> None:
        self._poked.set()

    def run(self) -> None:
        while not self.stop.is_set():
            self.turn()
            self._poked.wait(self.interval)
            self._poked.clear()

    def turn(self) -> None:
        raise NotImplementedError


def take_all(inbox: queue.SimpleQueue[J], timeout: float) -> list[J]:
    """What the inbox holds once something is there (waiting at most `timeout`), all of it:
    a loop acts on a burst in one turn."""
    try:
        found = [inbox.get(timeout=timeout)]
    except queue.Empty:
        return []
    while True:
        try:
            found.append(inbox.get_nowait())
        except queue.Empty:
            return found
