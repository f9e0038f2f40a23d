"""A loopback HTTP server for one file that answers `Range: bytes=a-b` with 206, as PyPI's
file host does: the lazy wheel reader's peer in tests that must not need the network."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@contextmanager
def serving(path: Path) -> Iterator[str]:
    """The file's URL while it is served."""
    data = path.read_bytes()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
            if found is None:
                self.send_response(200)
                body = data
            else:
                low, high = int(found[1]), min(int(found[2]), len(data) - 1)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {low}-{high}/{len(data)}")
                body = data[low : high + 1]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/{path.name}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
