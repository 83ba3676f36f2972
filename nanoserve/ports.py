"""free_port: a TCP port that nothing listens on, for the processes the engine starts (tensor-parallel ranks,
a server under test) to meet on. The OS picks it; bind it soon, another process may take it later."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` (loopback by default) right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
