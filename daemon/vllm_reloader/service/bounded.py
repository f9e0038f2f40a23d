"""A threading socket server that serves at most so many clients at once: a client that never
finishes its request holds a thread until its handler's timeout, so more are refused at once
rather than let any caller exhaust the daemon's threads."""

from __future__ import annotations

import socketserver
import sys
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

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone before its answer (a balancer's check that timed out) is no error of ours."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)  # type: ignore[misc]

    def refuse(self, request: Any) -> None:
        """Say why, if the protocol has a way (before the connection is shut)."""
