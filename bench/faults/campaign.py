"""What every scenario of the reliability campaign shares: its scale, its report, and
the daemon it runs against.

A scenario is a module with ``run(scale: Scale, workdir: Path) -> Report``. It
drives a real ``kvstore serve`` (or a real store) through one kind of fault,
checks every byte it reads back against what it wrote, and reports figures:
counts and times, and the figures that must be zero (wrong bytes, 5xx, lost
acknowledged blocks) named in ``must_be_zero``. ``bench/reliability.py`` prints
and emits them; the short form of each runs in ``make test``.

Every loop is bounded twice: by its count at the scale it runs at, and by
``scale.seconds`` of wall clock.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import ServerProcess

from kvstore import KVLayout

# The chains the kill loop and the soak write: chain ``n`` is its own tokens and its
# own seeded random K/V, so whoever reads it back can say what it must hold.
CHAIN_LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", chunk_tokens=16)
CHAIN_CHUNKS = 4


def chain_tokens(chain: int) -> np.ndarray:
    start = chain * CHAIN_CHUNKS * CHAIN_LAYOUT.chunk_tokens
    return np.arange(start, start + CHAIN_CHUNKS * CHAIN_LAYOUT.chunk_tokens, dtype=np.int64)


def chain_chunks(chain: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(chain)
    return [
        torch.randn(CHAIN_LAYOUT.chunk_shape, generator=generator).to(torch.float16)
        for _ in range(CHAIN_CHUNKS)
    ]


def same_bytes(chunk: Any, tensor: torch.Tensor) -> bool:
    """Whether a chunk read back holds exactly ``tensor``'s bytes."""
    return bytes(chunk.payload) == tensor.view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True)
class Scale:
    """How hard a scenario pushes: ``short`` (CI, seconds) or ``long`` (``make soak``)."""

    name: str
    cycles: int  # fault cycles (kills, restarts, fault windows) per scenario
    requests: int  # requests (or fuzz cases) per cycle
    seconds: float  # wall clock a scenario may take, whatever its counts say

    def until(self) -> float:
        """The ``time.monotonic`` deadline of a scenario started now."""
        return time.monotonic() + self.seconds


SHORT = Scale("short", cycles=5, requests=40, seconds=60.0)
LONG = Scale("long", cycles=200, requests=400, seconds=1800.0)


@dataclass
class Report:
    """A scenario's figures; ``must_be_zero`` names those that fail it unless 0."""

    scenario: str
    figures: dict[str, Any] = field(default_factory=dict)
    must_be_zero: tuple[str, ...] = ()

    def failures(self) -> dict[str, Any]:
        """The must-be-zero figures that are not."""
        return {name: self.figures[name] for name in self.must_be_zero if self.figures[name]}

    def to_dict(self) -> dict[str, Any]:
        return {
            "figures": self.figures,
            "must_be_zero": list(self.must_be_zero),
            "failures": self.failures(),
        }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class DaemonSpec:
    """A ``kvstore serve`` over ``root``: its tiers (TOML tables below ``[tiers]``) and
    extra ``[daemon]`` settings. The Unix socket is ``root/kvstore.sock``; TCP is on a
    free loopback port with a random token."""

    root: Path
    tiers: str = '[tiers.dram]\ncapacity = "64MiB"\n\n[tiers.ssd]\ncapacity = "512MiB"\n'
    daemon: Mapping[str, Any] = field(default_factory=dict)
    store: Mapping[str, Any] = field(default_factory=dict)

    @property
    def socket_path(self) -> Path:
        return self.root / "kvstore.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def process(self) -> ServerProcess:
        """The daemon's process, not yet started (a context manager: ``with``)."""
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "kvstore.toml"
        settings = {
            "socket_path": str(self.socket_path),
            "log_level": "warning",
            **self.daemon,
        }
        store = {"data_dir": str(self.root / "data"), **self.store}
        config.write_text(
            "".join(f"{name} = {_toml(value)}\n" for name, value in store.items())
            + "\n"
            + self.tiers
            + "\n[daemon]\n"
            + "".join(f"{name} = {_toml(value)}\n" for name, value in settings.items())
        )
        argv = [sys.executable, "-m", "kvstore", "serve", "--config", str(config)]
        return ServerProcess("kvstore serve", argv, self.socket_path, self.root / "daemon.log")


def tcp_settings() -> dict[str, Any]:
    """``[daemon]`` settings for a TCP listener on a free loopback port with a token."""
    return {"tcp_host": "127.0.0.1", "tcp_port": free_port(), "auth_token": secrets.token_hex(16)}


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux ``/proc``), 0 where unknown."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def open_fds(pid: int) -> int:
    """File descriptors process ``pid`` holds (Linux ``/proc``), 0 where unknown."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0
