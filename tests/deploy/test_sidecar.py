"""The same-pod sidecar (``deploy/k8s/sidecar``) for real, without Kubernetes.

A pod's two containers share only what the pod mounts into both: a small tmpfs at
``/dev/shm`` (an ``emptyDir`` of medium Memory) and the directory of the daemon's
socket. Here each runs in a mount namespace of its own (``unshare``, as root) with
the pod's tmpfs bound over its ``/dev/shm``, as the kubelet binds the emptyDir into
each container; the engine's side cannot see the daemon's data directory. The
engine then gets blocks through the shared-memory arena, which exists nowhere but
in the pod's tmpfs, and the daemon, configured for more DRAM than the tmpfs holds,
sizes its arena down with a warning instead of dying of SIGBUS at its first put.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.daemon import Daemon

from kvstore.local.processes import die_with_parent

TESTS = Path(__file__).resolve().parents[1]
POD_SHM_MIB = 64
DRAM_MIB = 256  # more than the pod's /dev/shm holds


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"],
        capture_output=True,
        timeout=10,
        check=False,
    )
    return done.returncode == 0


pytestmark = pytest.mark.skipif(
    not _can_unshare(), reason="needs root and unshare(1) for mount namespaces"
)


def in_container(pod: Path, hidden: Path | None = None) -> list[str]:
    """An argv prefix: the command runs in a mount namespace of its own whose /dev/shm
    is the pod's tmpfs (and where ``hidden``, another container's directory, is empty)."""
    script = f"mount --bind {pod / 'shm'} /dev/shm"
    if hidden is not None:
        script += f" && mount -t tmpfs -o size=1m elsewhere {hidden}"
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            script + ' && exec "$@"', "container"]  # fmt: skip


@pytest.fixture
def pod() -> Iterator[Path]:
    """The pod's volumes: a tmpfs of 64 MiB for /dev/shm, a directory for the socket.
    Short paths: a Unix socket's path is at most 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="kvs-pod-", dir="/tmp"))
    (root / "shm").mkdir()
    (root / "socket").mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={POD_SHM_MIB}m", "pod-shm", str(root / "shm")],
        check=True,
        timeout=10,
    )
    try:
        yield root
    finally:
        subprocess.run(["umount", "--lazy", str(root / "shm")], check=False, timeout=10)
        shutil.rmtree(root, ignore_errors=True)


ENGINE = """
import json, sys
from pathlib import Path
import torch
sys.path.insert(0, {tests!r})
from support import kv
from kvstore.client import connect

ns = kv.namespace(salt="sidecar")
tokens, chunks = kv.tokens(4), kv.chunks(4, seed=5)
with connect({url!r}, transfer="shm") as client:
    stored = client.put(ns, tokens, chunks)
    keys = client.lookup(ns, tokens).keys
    got = client.get(ns, keys)
    same = [bytes(g.payload) == c.view(torch.uint8).numpy().tobytes() for g, c in zip(got, chunks)]
    stats = client.client_stats()
print(json.dumps({{
    "stored": stored,
    "same": same,
    "corrupt": stats.corrupt_blocks,
    "segments": sorted(p.name for p in Path("/dev/shm").iterdir()),
    "daemon_dir": sorted(p.name for p in Path({data_dir!r}).iterdir()),
}}))
"""


def test_the_engine_reads_blocks_from_the_arena_in_the_pods_tmpfs_alone(
    pod: Path, daemon_factory: Callable[..., Daemon]
) -> None:
    store = (
        'data_dir = "{data_dir}"\n\n'
        f'[tiers.dram]\ncapacity = "{DRAM_MIB}MiB"\n\n[tiers.ssd]\ncapacity = "256MiB"\n'
    )
    daemon = daemon_factory(
        store,
        daemon={"socket_path": str(pod / "socket" / "kvstore.sock")},
        launcher=in_container(pod),
    )
    data_dir = daemon.data_dir
    warning = "wants 256 MiB of shared memory but /dev/shm has 64 MiB free"
    assert warning in daemon.log()
    script = ENGINE.format(tests=str(TESTS), url=daemon.url, data_dir=str(data_dir))
    done = subprocess.run(
        [*in_container(pod, hidden=data_dir), sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=die_with_parent,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["stored"] == 4 and seen["same"] == [True] * 4 and seen["corrupt"] == 0
    assert seen["daemon_dir"] == []  # the engine's container sees none of the daemon's files
    segments = [name for name in seen["segments"] if name.startswith("kvstore-")]
    assert segments, "the arena is in the pod's /dev/shm"
    # ... and only there: not in the host's, which neither container mounts.
    host = set(os.listdir("/dev/shm"))
    assert not host & set(segments)
    with daemon.client() as http:
        metrics = http.get("/metrics").text.splitlines()

    def total(series: str, label: str) -> float:
        lines = [line for line in metrics if line.startswith(series) and label in line]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    # Sized down to the pod's tmpfs; and the get went through shared memory (its lease
    # was released: a get of bytes takes none).
    assert 0 < total("kvstore_tier_capacity_bytes", 'tier="dram"') < POD_SHM_MIB << 20
    assert total("kvstore_http_requests_total", 'release"') >= 1
