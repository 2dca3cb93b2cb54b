"""Resource faults against a real daemon or store: each resource run short, and what
the store must do instead of dying or losing acknowledged data.

=================  ==============================================================
fault              what must hold
=================  ==============================================================
``/dev/shm`` small  a DRAM tier four times larger than a private 16 MiB tmpfs over
                    /dev/shm: sized down, written past its size, no SIGBUS
disk full           LMDB on a 512 KiB tmpfs under a tier that believes it has
                    64 MiB: new puts refused, no acknowledged block lost
LMDB meta corrupt   both meta pages overwritten: the daemon starts (moving the
                    environment aside) and serves
namespace table     four times ``max_namespaces`` engines' namespaces through one
                    daemon: no call raises into an engine
file descriptors    the daemon under ``ulimit -n 128`` flooded with 300 idle
                    connections: it survives, and serves once they are gone
=================  ==============================================================

The first two need root (a tmpfs mount, a mount namespace); where they cannot
run they report ``skipped``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import torch

from faults.campaign import DaemonSpec, Report, Scale
from kvstore import KVLayout, Namespace, connect
from kvstore.keys import chunk_keys
from kvstore.kinds import TierKind
from kvstore.store.config import StoreConfig
from kvstore.store.tiered_store import TieredStore
from kvstore.tiers.registry import TierConfig

NAME = "resources"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", chunk_tokens=16)
REPO = Path(__file__).resolve().parents[2]


def run(scale: Scale, workdir: Path) -> Report:
    figures: dict[str, object] = {}
    must_be_zero: list[str] = []
    for check in (_small_shm, _full_disk, _corrupt_meta, _namespace_table, _fd_exhaustion):
        found, zero = check(workdir / check.__name__.strip("_"))
        figures |= found
        must_be_zero += zero
    return Report(NAME, figures, must_be_zero=tuple(must_be_zero))


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None


def _small_shm(workdir: Path) -> tuple[dict[str, object], list[str]]:
    if not _can_mount():
        return {"shm_small": "skipped (needs root)"}, []
    workdir.mkdir(parents=True)
    script = workdir / "fill.py"
    script.write_text(
        textwrap.dedent(
            """
            import numpy as np, torch
            from kvstore import KVLayout, Namespace
            from kvstore.store.config import StoreConfig
            from kvstore.store.tiered_store import TieredStore
            from kvstore.kinds import TierKind
            from kvstore.tiers.registry import TierConfig
            layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                              chunk_tokens=16)
            ns = Namespace("shm-small", layout)
            store = TieredStore(StoreConfig(tiers=(TierConfig(TierKind.DRAM, 64 << 20),)))
            print("capacity", store.stats().tiers[TierKind.DRAM].capacity_bytes, flush=True)
            chunk = [torch.zeros(layout.chunk_shape, dtype=torch.float16)] * 16
            for n in range(750):  # 48 MiB of 4 KiB slots
                store.put(ns, np.arange(256 * n, 256 * (n + 1)), chunk)
            store.close()
            print("done", flush=True)
            """
        )
    )
    command = f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} {script}"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    capacity = next(
        (int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("capacity")),
        0,
    )
    return {
        "shm_small_sigbus": int(done.returncode == -7),  # SIGBUS
        "shm_small_failed": int(done.returncode != 0 or "done" not in done.stdout),
        "shm_small_capacity_mib": capacity >> 20,
    }, ["shm_small_sigbus", "shm_small_failed"]


def _full_disk(workdir: Path) -> tuple[dict[str, object], list[str]]:
    if not _can_mount():
        return {"disk_full": "skipped (needs root)"}, []
    disk = workdir / "disk"
    disk.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)], check=True)
    namespace = Namespace("disk-full", LAYOUT)
    acknowledged: dict[int, bytes] = {}
    try:
        config = StoreConfig(
            tiers=(
                TierConfig(TierKind.DRAM, 8 * 4096),
                TierConfig(TierKind.SSD, 64 << 20, path=disk / "lmdb"),
            )
        )
        with TieredStore(config) as store:
            for n in range(600):
                chunk = torch.full(LAYOUT.chunk_shape, float(n % 1000), dtype=torch.float16)
                if store.put(namespace, _tokens(n), [chunk]) == 1:
                    acknowledged[n] = chunk.view(torch.uint8).numpy().tobytes()
            lost = 0
            for n, expected in acknowledged.items():
                got = store.get(namespace, chunk_keys(namespace, _tokens(n)))[0]
                lost += got is None or bytes(got.payload) != expected
            stats = store.stats()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    return {
        "disk_full_puts": 600,
        "disk_full_refused": 600 - len(acknowledged),
        "disk_full_acknowledged_lost": lost,
        "disk_full_writebacks_failed": stats.tiers[TierKind.DRAM].writebacks_failed,
    }, ["disk_full_acknowledged_lost"]


def _corrupt_meta(workdir: Path) -> tuple[dict[str, object], list[str]]:
    spec = DaemonSpec(workdir)
    namespace = Namespace("corrupt-meta", LAYOUT)
    chunk = [torch.ones(LAYOUT.chunk_shape, dtype=torch.float16)]
    with spec.process(), connect(spec.url) as store:
        store.put(namespace, _tokens(0), chunk)
    data = workdir / "data" / "lmdb" / "data.mdb"
    with data.open("r+b") as file:
        file.write(b"\xa5" * 8192)  # both meta pages
    started = 0
    served = 0
    try:
        with spec.process(), connect(spec.url) as store:
            started = 1
            served = int(store.put(namespace, _tokens(1), chunk) == 1)
    except RuntimeError:  # did not answer /healthz: it would not start
        pass
    moved = len(list((workdir / "data").glob("lmdb.corrupt-*")))
    return {
        "corrupt_meta_not_started": 1 - started,
        "corrupt_meta_not_serving": 1 - served,
        "corrupt_meta_moved_aside": moved,
    }, ["corrupt_meta_not_started", "corrupt_meta_not_serving"]


def _namespace_table(workdir: Path) -> tuple[dict[str, object], list[str]]:
    limit = 4
    spec = DaemonSpec(workdir, daemon={"max_namespaces": limit})
    raised = 0
    found = 0
    namespaces = [Namespace("engine", LAYOUT, tenant_salt=f"t{n}") for n in range(4 * limit)]
    chunk = [torch.ones(LAYOUT.chunk_shape, dtype=torch.float16)]
    with spec.process(), connect(spec.url) as store:
        for _ in range(2):
            for namespace in namespaces:
                try:
                    store.put(namespace, _tokens(0), chunk)
                    found += store.lookup(namespace, _tokens(0)).num_chunks
                except Exception:  # noqa: BLE001 - any exception reached the engine
                    raised += 1
        forgotten = store.stats().namespaces_forgotten
    return {
        "namespaces_used": len(namespaces),
        "namespace_limit": limit,
        "namespace_errors_raised": raised,
        "namespace_lookups_missed": 2 * len(namespaces) - found,
        "namespaces_forgotten": forgotten,
    }, ["namespace_errors_raised", "namespace_lookups_missed"]


def _fd_exhaustion(workdir: Path) -> tuple[dict[str, object], list[str]]:
    spec = DaemonSpec(workdir)
    process = spec.process()
    command = " ".join(process.argv)
    process.argv = ["sh", "-c", f"ulimit -n 128 && exec {command}"]
    crashed = 0
    served = 0
    with process:
        held: list[socket.socket] = []
        for _ in range(300):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(1.0)
            try:
                sock.connect(str(spec.socket_path))
            except OSError:
                sock.close()
                continue
            held.append(sock)
        time.sleep(1.0)
        for sock in held:
            sock.close()
        crashed = int(process.proc is None or process.proc.poll() is not None)
        if not crashed:
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline and not served:
                with connect(spec.url, timeout_s=2.0) as store:
                    served = int(store.lookup(Namespace("fd", LAYOUT), _tokens(0)).num_chunks == 0)
                    served &= int(store.client_stats().lookups_failed == 0)
                if not served:
                    time.sleep(0.5)
    return {
        "fd_connections_opened": len(held),
        "fd_daemon_crashed": crashed,
        "fd_not_serving_after": 1 - served,
    }, ["fd_daemon_crashed", "fd_not_serving_after"]


def _tokens(n: int) -> np.ndarray:
    return np.arange(16 * n, 16 * (n + 1), dtype=np.int64)
