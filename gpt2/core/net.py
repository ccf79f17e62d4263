"""Whether a network service answers at all, asked in seconds instead of a client's minutes of retries."""

from __future__ import annotations

import socket
from urllib.parse import urlparse


def reachable(url: str, timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the URL's host and port opens within ``timeout_s``."""
    where = urlparse(url)
    port = where.port or (443 if where.scheme == "https" else 80)
    try:
        with socket.create_connection((where.hostname, port), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
