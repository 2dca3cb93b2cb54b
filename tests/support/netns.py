"""Hosts as Linux network namespaces: each its own network stack, joined to a bridge.

::

    root namespace                                 namespace kvs-<tag>-h0
    ┌───────────────────────────┐   veth pair     ┌─────────────────────────┐
    │ bridge kvb<tag>           ├─ kvh<tag>0 ──── eth0  10.77.K.2/24, lo up   │
    │ 10.77.K.1/24 (gateway)    │                 └─────────────────────────┘
    │ shared servers bind here  ├─ kvh<tag>1 ──── eth0  10.77.K.3/24 (h1) ...
    └───────────────────────────┘

A process started in a host's namespace (``Host.launcher``: ``ip netns exec
NAME``) sees only its ``lo`` and its ``eth0``: it reaches the gateway, and the
other hosts across the bridge, only over its veth pair, so cutting that pair
cuts the host off as a pulled cable would. Path-based Unix sockets and
``/dev/shm`` are not network-namespaced: a daemon in a namespace still answers
on its socket file, and shares memory with, clients in the root namespace.

``Host.cut()`` sets the root namespace's end of the pair down. The host's
``eth0`` stays up (no carrier) and its route stays, so its packets are
dropped rather than refused: connects and reads time out, as they do when a
link is really lost. (``tc ... netem loss 100%`` would do the same; the link
state needs nothing beyond ``ip``.) ``restore()`` sets it up again.

Names carry the pid and a count (``<tag>``), and the subnet's third octet
``K`` is one that no interface of this machine uses yet, so runs side by
side, or a run's leftovers, do not clash. Everything made is removed in
``finally``, also when building it failed half way.

Fixture (registered in ``tests/conftest.py``):

``netns_network``   session-scoped ``Network`` of three hosts; skipped, saying
                    why, where namespaces cannot be made (not root, no ``ip``,
                    an unprivileged container).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

IP = shutil.which("ip")
SUBNET_PREFIX = "10.77"
HOSTS = 3
_RUNS = itertools.count()


class NetnsError(RuntimeError):
    """An ``ip`` command failed; carries what it said."""


def _ip(*args: str, timeout_s: float = 10.0) -> str:
    assert IP is not None
    done = subprocess.run(
        [IP, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Host:
    """One network namespace, joined to the bridge by a veth pair."""

    name: str  # the namespace
    address: str  # its eth0's address on the bridge's subnet
    link: str  # the root namespace's end of its veth pair: what ``cut`` sets down

    @property
    def launcher(self) -> list[str]:
        """The argv prefix that runs a command in this namespace."""
        assert IP is not None
        return [IP, "netns", "exec", self.name]

    def run(self, *command: str, timeout_s: float = 10.0) -> subprocess.CompletedProcess[str]:
        """Run ``command`` in this namespace and wait for it (output captured)."""
        return subprocess.run(
            [*self.launcher, *command],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def cut(self) -> None:
        """Take this host off the network: its packets are dropped from now on."""
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")

    @contextlib.contextmanager
    def cut_off(self) -> Iterator[None]:
        """The host off the network for the block, back on after it (also on failure)."""
        self.cut()
        try:
            yield
        finally:
            self.restore()


@dataclass(frozen=True)
class Network:
    """A bridge in the root namespace and the hosts joined to it."""

    bridge: str
    gateway: str  # the bridge's own address: servers every host reaches bind here
    hosts: tuple[Host, ...]


def _free_octet() -> int:
    """A third octet ``K`` such that no interface here has an address in 10.77.K.0/24."""
    used = _ip("-o", "-4", "addr", "show")
    start = os.getpid() % 256
    for step in range(256):
        octet = (start + step) % 256
        if f" {SUBNET_PREFIX}.{octet}." not in used:
            return octet
    raise NetnsError(f"every {SUBNET_PREFIX}.K.0/24 subnet is in use")


@contextlib.contextmanager
def network(hosts: int = HOSTS) -> Iterator[Network]:
    """A bridge and ``hosts`` namespaces joined to it, removed on exit.

    Raises ``NetnsError`` where any of it cannot be made (what was made is
    removed first)."""
    tag = f"{os.getpid()}{chr(ord('a') + next(_RUNS) % 26)}"
    subnet = f"{SUBNET_PREFIX}.{_free_octet()}"
    bridge = f"kvb{tag}"
    made_bridge = False
    namespaces: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made_bridge = True
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        joined = []
        for index in range(hosts):
            host = Host(f"kvs-{tag}-h{index}", f"{subnet}.{index + 2}", f"kvh{tag}{index}")
            _ip("netns", "add", host.name)
            namespaces.append(host.name)
            _join(host, bridge)
            joined.append(host)
        yield Network(bridge, f"{subnet}.1", tuple(joined))
    finally:
        # A namespace's deletion takes its end of the veth pair, and so the pair.
        for name in namespaces:
            with contextlib.suppress(NetnsError):
                _ip("netns", "delete", name)
        if made_bridge:
            with contextlib.suppress(NetnsError):
                _ip("link", "delete", bridge)


def _join(host: Host, bridge: str) -> None:
    """A veth pair from ``bridge`` to ``host``'s eth0, addressed and up, with lo up."""
    _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.name)
    _ip("link", "set", host.link, "master", bridge, "up")
    inside: Sequence[tuple[str, ...]] = (
        ("addr", "add", f"{host.address}/24", "dev", "eth0"),
        ("link", "set", "eth0", "up"),
        ("link", "set", "lo", "up"),
    )
    for args in inside:
        _ip("-n", host.name, *args)


def _unavailable() -> str | None:
    """Why namespaces cannot be made here, where that is plain without trying."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if IP is None:
        return "the ip command (iproute2) is not installed"
    return None


@pytest.fixture(scope="session")
def netns_network() -> Iterator[Network]:
    """Three hosts on one bridge for the session; skipped where they cannot be made."""
    reason = _unavailable()
    if reason is not None:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        try:
            built = stack.enter_context(network())
        except NetnsError as error:
            pytest.skip(f"cannot make network namespaces here: {error}")
        yield built
