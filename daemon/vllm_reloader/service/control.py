"""The control endpoint: a unix socket in the state dir, one JSON request and answer per line.

The server thread only parses a request and enqueues it with a reply slot; the main loop
answers (so status is consistent and pin/unpin change state on the one thread that acts).
A request is either answered with its outcome or not applied at all: the loop claims the
slot before acting, the server thread abandons it when its wait runs out, and only one of
the two can win. A client has `READ_TIMEOUT` to send its line; at most `MAX_CLIENTS` are
served at once, the next one is told the daemon is busy.
Access is the socket's file mode (0660): whoever may write to it may steer the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ControlError
from .bounded import Bounded

COMMANDS = ("status", "reload", "pin", "unpin")
ANSWER_TIMEOUT = 30.0
READ_TIMEOUT = 5.0
MAX_CLIENTS = 16
MAX_PATH_BYTES = 107
"""sun_path holds 108 bytes, the terminating NUL included."""


Request = dict[str, Any]


class Reply:
    """One request's answer slot, shared by a server thread and the loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "waiting"
        self._answer: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()

    def claim(self) -> bool:
        """The loop, before acting: False when the client was already told it timed out."""
        with self._lock:
            if self._state != "waiting":
                return False
            self._state = "claimed"
            return True

    def put(self, answer: dict[str, Any]) -> None:
        self._answer.put(answer)

    def wait(self, timeout: float) -> dict[str, Any] | None:
        """The answer; None when the loop had not claimed the request in time (so it never will)."""
        try:
            return self._answer.get(timeout=timeout)
        except queue.Empty:
            with self._lock:
                if self._state == "waiting":
                    self._state = "abandoned"
                    return None
        return self._answer.get(timeout=timeout)  # claimed just now: the answer is being made


class _Server(Bounded, socketserver.UnixStreamServer):
    def limit(self) -> int:
        return MAX_CLIENTS

    def refuse(self, request: Any) -> None:
        with contextlib.suppress(OSError):
            request.sendall(b'{"ok": false, "error": "busy: too many control clients at once"}\n')

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away or said nothing is not the daemon's error."""


class ControlServer:
    """Accepts requests on `path` and hands each to `enqueue(request, reply)`."""

    def __init__(self, path: Path, enqueue: Callable[[Request, Reply], None]) -> None:
        self.path = path

        class Handler(socketserver.StreamRequestHandler):
            timeout = READ_TIMEOUT

            def handle(self) -> None:
                answer = _answer(self.rfile.readline(1 << 16), enqueue)
                self.wfile.write(json.dumps(answer).encode() + b"\n")

        if len(os.fsencode(path)) > MAX_PATH_BYTES:
            raise ConfigError(
                f"control.socket {path}: longer than the {MAX_PATH_BYTES} bytes a unix socket path may have"
            )
        try:
            path.unlink(missing_ok=True)
            self._server = _Server(str(path), Handler)
            os.chmod(path, 0o660)
        except OSError as exc:
            raise ConfigError(f"control.socket {path}: cannot listen: {exc.strerror or exc}") from exc
        self._thread = threading.Thread(target=self._server.serve_forever, name="control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)


def _answer(line: bytes, enqueue: Callable[[Request, Reply], None]) -> dict[str, Any]:
    try:
        request = json.loads(line)
    except (ValueError, RecursionError):
        return {"ok": False, "error": "request is not JSON"}
    if not isinstance(request, dict) or request.get("command") not in COMMANDS:
        return {"ok": False, "error": f"command must be one of {', '.join(COMMANDS)}"}
    reply = Reply()
    enqueue(request, reply)
    answer = reply.wait(ANSWER_TIMEOUT)
    if answer is None:
        return {"ok": False, "error": "the daemon did not answer in time; nothing was applied"}
    return answer


def call(path: Path, command: str, **fields: Any) -> dict[str, Any]:
    """Client side, for the CLI: one request, one answer."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(ANSWER_TIMEOUT + 5)
            sock.connect(str(path))
            # A busy daemon answers at once and hangs up: its answer is still there to read.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(json.dumps({"command": command, **fields}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        raise ControlError(unreachable(path, exc)) from exc
    try:
        answer = json.loads(data)
    except ValueError as exc:
        raise ControlError(f"{path}: the daemon's answer is not JSON") from exc
    if not isinstance(answer, dict):
        raise ControlError(f"{path}: unexpected answer")
    return answer


NOT_RUNNING = (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR)
"""No socket, or nobody listening on it: no daemon runs with this config's socket."""
NOT_ALLOWED = (errno.EACCES, errno.EPERM)


def unreachable(path: Path, exc: OSError) -> str:
    """One line that says what to check: an operator meets this before any daemon log."""
    if isinstance(exc, TimeoutError):
        return f"the daemon at {path} did not answer in {ANSWER_TIMEOUT + 5:.0f} s (is it stuck? see its log)"
    said = f"cannot reach the daemon at {path}: {exc.strerror or exc}"
    if exc.errno in NOT_RUNNING:
        return f"{said} (is vllm-reloader running with this --config?)"
    if exc.errno in NOT_ALLOWED:
        return f"{said} (is your user in the daemon's group? the socket is mode 0660)"
    return f"{said} (is vllm-reloader running with this --config? is your user in its group?)"
