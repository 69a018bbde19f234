"""Local networking helpers: internal channels listen on loopback only."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (never 0.0.0.0: nothing internal is reachable remotely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
