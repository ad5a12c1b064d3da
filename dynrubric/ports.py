"""Free loopback ports for the services this project starts on one machine (tests, `up`, the fleet)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on `host` now. Another process may take it before the caller
    binds it: fine for loopback services started right away, which fail loudly on a taken port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
