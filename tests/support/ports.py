"""A loopback port nothing listens on when asked (a server about to bind it, or a peer that
refuses connections)."""

from __future__ import annotations

import socket


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
