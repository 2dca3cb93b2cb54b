"""Child processes of the test session: free ports, and no process left behind.

Every server a fixture starts (redis-server, ``kvstore serve``) is registered
with ``track``: an ``atexit`` hook kills what is still alive, and each child
is started with ``die_with_parent`` so the kernel stops it even if pytest
itself is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import signal
import socket
import subprocess
import sys

HOST = "127.0.0.1"
_CLUSTER_BUS_OFFSET = 10000
_PR_SET_PDEATHSIG = 1

LIVE: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_leftovers() -> None:
    """Backstop for sessions that die before their fixtures' ``finally`` runs."""
    for proc in list(LIVE):
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        LIVE.discard(proc)


def die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the test process dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A loopback port nobody listens on (and ``port + 10000`` too, for cluster nodes)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if not cluster_bus:
            return port
        if port + _CLUSTER_BUS_OFFSET < 65536 and _port_is_free(port + _CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free loopback port found")
