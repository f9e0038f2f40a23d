"""A socket server that serves at most so many clients at once, on threads made once and
reused: a client that never finishes its request holds a thread until its handler's
timeout, so more are refused at once rather than let any caller exhaust the daemon's
threads; and no thread is started per request (on a host whose cores are saturated a new
thread waited seconds to be scheduled, and a balancer's health check timed out on it)."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class Bounded:
    """Mixed in before a `socketserver` server class, which says its `limit`."""

    def limit(self) -> int:
        return 16

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(self.limit())
        self._pool = ThreadPoolExecutor(self.limit(), thread_name_prefix=type(self).__module__)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refuse(request)
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)  # type: ignore[attr-defined]
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)  # type: ignore[attr-defined]
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()  # type: ignore[misc]
        self._pool.shutdown(wait=False, cancel_futures=True)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone before its answer (a balancer's check that timed out) is no error of ours."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)  # type: ignore[misc]

    def refuse(self, request: Any) -> None:
        """Say why, if the protocol has a way (before the connection is shut)."""
