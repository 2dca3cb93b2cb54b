"""kill -9 of the daemon's whole process group, at random points during write bursts and
during startup, then every block it ever acknowledged read back byte for byte.

Each cycle starts ``kvstore serve`` (DRAM + LMDB), lets a client write chains
for a random while and SIGKILLs the process group mid-burst, as ``systemctl
kill`` does (the resource tracker dies too, so the DRAM segment is left in
``/dev/shm`` for the next start to remove). One cycle in five is killed while
it is still starting instead. Every fifth cycle stops gracefully, which
flushes DRAM to LMDB: from then on those blocks are *durable* and must
survive every later kill.

After each restart every chain ever acknowledged is read back: a block may be
missing (DRAM died with its process) but never different from what was put
(``wrong_reads``), and no durable block may be missing (``durable_lost``).
``stale_segments`` counts ``kvstore-<dead pid>-*`` segments still in
``/dev/shm`` after the last start.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from faults.campaign import (
    CHAIN_CHUNKS,
    CHAIN_LAYOUT,
    DaemonSpec,
    Report,
    Scale,
    chain_chunks,
    chain_tokens,
    same_bytes,
)
from kvstore import Namespace, connect
from kvstore.keys import chunk_keys
from kvstore.local.processes import spawn
from kvstore.tiers import shm_segments

NAME = "kill_loop"
NAMESPACE = Namespace("kill-loop", CHAIN_LAYOUT)


@dataclass
class _Written:
    """Every chain a put acknowledged, and those known to be on disk."""

    chains: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    durable: set[int] = field(default_factory=set)
    next_id: int = 0
    daemon_pids: set[int] = field(default_factory=set)  # whose segments must not stay


def run(scale: Scale, workdir: Path) -> Report:
    spec = DaemonSpec(workdir / "daemon", daemon={"flush_timeout_s": 30.0})
    rng = random.Random(20261201)
    written = _Written()
    figures: dict[str, int | float] = dict.fromkeys(
        (
            "cycles",
            "killed_starting",
            "killed_writing",
            "graceful_stops",
            "restarts_ok",
            "wrong_reads",
            "durable_lost",
            "chunks_verified",
        ),
        0,
    )
    serve_times: list[float] = []
    deadline = scale.until()
    for cycle in range(scale.cycles):
        if time.monotonic() > deadline:
            break
        figures["cycles"] += 1
        if cycle % 5 == 1:
            _kill_while_starting(spec, rng, written)
            figures["killed_starting"] += 1
            continue
        started = time.monotonic()
        with spec.process() as daemon:
            written.daemon_pids.add(daemon.pid)
            serve_times.append(time.monotonic() - started)
            figures["restarts_ok"] += 1
            wrong, lost, verified, whole = _verify(spec, written)
            figures["wrong_reads"] += wrong
            figures["durable_lost"] += lost
            figures["chunks_verified"] += verified
            graceful = cycle % 5 == 4
            first_new = written.next_id
            with _writing(spec, written):
                time.sleep(rng.uniform(0.2, 1.0))
                if not graceful:
                    os.killpg(daemon.pid, signal.SIGKILL)  # mid-burst
                    figures["killed_writing"] += 1
            if graceful:
                daemon.__exit__()  # SIGTERM: drain, and flush DRAM to LMDB
                # On disk now: what this start still had whole, and what it was given.
                written.durable = whole | {i for i in written.chains if i >= first_new}
                figures["graceful_stops"] += 1
    with spec.process():  # the last word: everything readable is right
        wrong, lost, verified, _ = _verify(spec, written)
    figures["wrong_reads"] += wrong
    figures["durable_lost"] += lost
    figures["chunks_verified"] += verified
    figures["stale_segments"] = _stale_segments(written.daemon_pids)
    figures["chains_acknowledged"] = len(written.chains)
    figures["time_to_serve_p50_s"] = round(statistics.median(serve_times), 3) if serve_times else 0
    figures["time_to_serve_max_s"] = round(max(serve_times), 3) if serve_times else 0
    return Report(NAME, figures, must_be_zero=("wrong_reads", "durable_lost", "stale_segments"))


def _kill_while_starting(spec: DaemonSpec, rng: random.Random, written: _Written) -> None:
    """Start the daemon and SIGKILL its process group before it can answer."""
    process = spec.process()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    proc = spawn(process.argv, process.log_path, env=env, new_session=True)
    written.daemon_pids.add(proc.pid)
    time.sleep(rng.uniform(0.0, 1.5))
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@contextlib.contextmanager
def _writing(spec: DaemonSpec, written: _Written) -> Iterator[None]:
    """Put fresh chains from another thread while the body runs (and the daemon dies
    in it, or not). A chain counts as written when its put was acknowledged whole."""
    stop = threading.Event()

    def writer() -> None:
        with connect(spec.url, timeout_s=2.0, backoff_s=0.05) as store:
            while not stop.is_set():
                chain_id = written.next_id
                written.next_id += 1
                chunks = chain_chunks(chain_id)
                if store.put(NAMESPACE, chain_tokens(chain_id), chunks) == CHAIN_CHUNKS:
                    written.chains[chain_id] = chunks

    thread = threading.Thread(target=writer, name="kill-loop-writer")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


def _verify(spec: DaemonSpec, written: _Written) -> tuple[int, int, int, set[int]]:
    """Read every acknowledged chain: wrong chunks, durable chunks missing, chunks read
    right, and the chains read whole and right."""
    wrong = lost = verified = 0
    whole: set[int] = set()
    with connect(spec.url, timeout_s=10.0) as store:
        for chain_id, chunks in list(written.chains.items()):
            keys = chunk_keys(NAMESPACE, chain_tokens(chain_id))
            got = store.get(NAMESPACE, keys)
            right = 0
            for chunk, expected in zip(got, chunks, strict=True):
                if chunk is None:
                    lost += chain_id in written.durable
                elif not same_bytes(chunk, expected):
                    wrong += 1
                else:
                    right += 1
            verified += right
            if right == len(chunks):
                whole.add(chain_id)
    return wrong, lost, verified, whole


def _stale_segments(pids: set[int]) -> int:
    """Segments in /dev/shm that daemons of this run left and nobody removed."""
    try:
        names = os.listdir(shm_segments.SHM_DIR)
    except OSError:
        return 0
    return sum(1 for name in names if shm_segments.creator_pid(name) in pids)
