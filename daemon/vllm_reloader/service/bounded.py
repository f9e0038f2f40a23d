"""A threading socket server that serves at most so many clients at once: a client that never
finishes its request holds a thread until its handler's timeout, so more are refused at once
rather than let any caller exhaust the daemon's threads."""

from __future__ import annotations

import socketserver
import threading
from typing import Any


class Bounded(socketserver.ThreadingMixIn):
    """Mixed in before a `socketserver` server class, which says its `limit`."""

    daemon_threads = True

    def limit(self) -> int:
        return 16

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(self.limit())
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refuse(request)
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def refuse(self, request: Any) -> None:
        """Say why, if the protocol has a way (before the connection is shut)."""
