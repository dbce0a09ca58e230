"""Ports for servers a demo, a benchmark or a test starts itself and must name before they run.

A port asked of the kernel (bind to port 0, read it, close) comes from the ephemeral range, the
range every outgoing connection on the machine takes its local port from. Between that pick and the
server's own bind, any connection may take the port, and the server then fails to start ("address
already in use"; seen under the full test suite, where three workers open thousands of loopback
and PostgreSQL connections). :func:`free_port` therefore picks at random *outside* the ephemeral
range, where only another explicit bind can collide, and checks that the port is free now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Linux's setting; the kernel's default when it cannot be read.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)
#: Ports below this are left to the system's services.
LOWEST = 10000
TRIES = 200

_random = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The machine's ephemeral port range, inclusive."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def candidates() -> list[range]:
    """The port ranges :func:`free_port` picks from: above ``LOWEST`` and outside the ephemeral
    range (empty only on a machine whose ephemeral range covers all of them)."""
    low, high = ephemeral_range()
    return [r for r in (range(LOWEST, min(low, 65536)), range(max(high + 1, LOWEST), 65536)) if len(r)]


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing is bound to now, outside the ephemeral range where one is
    free there (else one the kernel picks)."""
    ranges = candidates()
    for _ in range(TRIES if ranges else 0):
        port = _random.choice(_random.choices(ranges, weights=[len(r) for r in ranges])[0])
        if _bindable(port, host):
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


__all__ = ["ephemeral_range", "free_port"]
