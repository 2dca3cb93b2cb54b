"""Child processes kvstore starts itself, and the loopback ports they listen on.

The replay starts a private ``redis-server`` (``kvstore.local.redis_server``),
and so do the benchmarks and the tests, which also start ``kvstore serve``
daemons. None of them may outlive its parent: every child is started with
``spawn`` (or registered in ``LIVE``), so

* the kernel sends it SIGTERM when the parent dies, even by SIGKILL
  (``PR_SET_PDEATHSIG``, set in the child before exec: ``die_with_parent``);
* an ``atexit`` hook kills whatever is still alive when the parent exits
  without having stopped it;

and ``stop_process`` stops one for good (SIGTERM, then SIGKILL if it lingers).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

HOST = "127.0.0.1"
# A Redis cluster node also listens on its port + 10000 (the cluster bus).
CLUSTER_BUS_OFFSET = 10000
_PR_SET_PDEATHSIG = 1

# Children started and not yet stopped; ``stop_process`` and the atexit hook remove them.
LIVE: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_leftovers() -> None:
    """Backstop for a parent that exits before stopping its children."""
    for proc in list(LIVE):
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        LIVE.discard(proc)


def die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the parent dies, even by SIGKILL."""
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
    """A loopback port nobody listens on (and ``port + 10000`` too, for cluster nodes).

    Never the shared 6379: the kernel hands out ephemeral ports only."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
        if not cluster_bus:
            return port
        if port + CLUSTER_BUS_OFFSET < 65536 and _port_is_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise OSError("no free loopback port found")


def spawn(
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """Start a child with its output appended to ``log_path``; it dies with the thread
    that started it (``PR_SET_PDEATHSIG`` follows the thread, not the process: start
    children that must outlive a worker thread from a thread that stays).

    ``new_session``: in a session of its own, so a Ctrl-C at the terminal reaches
    only the parent, which then stops the child in order."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            start_new_session=new_session,
            preexec_fn=die_with_parent,
        )
    LIVE.add(proc)
    return proc


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int:
    """SIGTERM and wait, SIGKILL if it lingers; the exit code. Idempotent.

    A stopped (SIGSTOP) child is continued first: it could not act on SIGTERM."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
    LIVE.discard(proc)
    return proc.returncode
