"""The control endpoint: a unix socket in the state dir, one JSON request and answer per line.

The server thread only parses a request and enqueues it with a reply slot; the main loop
answers (so status is consistent and pin/unpin change state on the one thread that acts).
Access is the socket's file mode (0660): whoever may write to it may steer the daemon.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ControlError

COMMANDS = ("status", "reload", "pin", "unpin")
ANSWER_TIMEOUT = 30.0


Request = dict[str, Any]


class ControlServer:
    """Accepts requests on `path` and hands each to `enqueue(request, reply_queue)`."""

    def __init__(self, path: Path, enqueue: Callable[[Request, Any], None]) -> None:
        self.path = path

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                answer = _answer(self.rfile.readline(1 << 16), enqueue)
                self.wfile.write(json.dumps(answer).encode() + b"\n")

        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        self._server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        self._server.daemon_threads = True
        os.chmod(path, 0o660)
        self._thread = threading.Thread(target=self._server.serve_forever, name="control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)


def _answer(line: bytes, enqueue: Callable[[Request, Any], None]) -> dict[str, Any]:
    try:
        request = json.loads(line)
    except ValueError:
        return {"ok": False, "error": "request is not JSON"}
    if not isinstance(request, dict) or request.get("command") not in COMMANDS:
        return {"ok": False, "error": f"command must be one of {', '.join(COMMANDS)}"}
    reply: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    enqueue(request, reply)
    try:
        return reply.get(timeout=ANSWER_TIMEOUT)
    except queue.Empty:
        return {"ok": False, "error": "the daemon did not answer in time"}


def call(path: Path, command: str, **fields: Any) -> dict[str, Any]:
    """Client side, for the CLI: one request, one answer."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(ANSWER_TIMEOUT + 5)
            sock.connect(str(path))
            sock.sendall(json.dumps({"command": command, **fields}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
    except OSError as exc:
        raise ControlError(f"cannot reach the daemon at {path}: {exc.strerror or exc}") from exc
    try:
        answer = json.loads(data)
    except ValueError as exc:
        raise ControlError(f"{path}: the daemon's answer is not JSON") from exc
    if not isinstance(answer, dict):
        raise ControlError(f"{path}: unexpected answer")
    return answer
