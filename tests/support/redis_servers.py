"""Fixtures of real ``redis-server`` processes, on free loopback ports.

No fakes: the Redis tier is tested against the server it will meet in
production, so timeouts, OOM replies and cluster redirections are the real
ones. The servers are ``kvstore.local.redis_server``'s, which the replay and
the benchmarks start too; they never outlive the session (``kvstore.local.processes``).

``redis_server``           session-scoped ``RedisServer``, shared by all tests.
``clean_redis``            function-scoped: the same server, restarted if a test
                           stopped it, then ``FLUSHALL``; use this one in tests.
``redis_server_factory``   function-scoped: ``make(*extra_args, password=, tls=)
                           -> RedisServer`` for a private server (``--maxmemory``,
                           stop/start, AUTH, TLS); every server it made is stopped
                           after the test.
``redis_cluster``          session-scoped ``RedisCluster`` of three masters.
``clean_redis_cluster``    function-scoped: the same cluster, stopped masters
                           restarted, after ``FLUSHALL`` on every master.
``tls_files``              session-scoped ``TLSFiles``: a throwaway CA, a server and
                           a client certificate it signed, and a CA that signed
                           neither (made by ``openssl``).
``secure_redis_cluster``   function-scoped: a session cluster of three masters with
                           ``requirepass``/``masterauth`` (``CLUSTER_PASSWORD``) that
                           speaks TLS only (``tls_files``), running and flushed.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.local.redis_cluster import RedisCluster
from kvstore.local.redis_server import REDIS_CLI, REDIS_SERVER, RedisServer, ServerTLS

CLUSTER_PASSWORD = "cluster-secret"
OPENSSL = shutil.which("openssl")


def require_redis() -> None:
    # A failure, not a skip: the Redis tests are the Redis tier's only proof, and a
    # machine without redis-server must not pass them silently.
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.fail("redis-server and redis-cli must be on the PATH (apt-get install redis-server)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One standalone server for the whole session; prefer ``clean_redis`` in tests."""
    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def clean_redis(redis_server: RedisServer) -> RedisServer:
    """The session server, running (a test may have stopped it) and empty."""
    redis_server.start()
    redis_server.flushall()
    return redis_server


@pytest.fixture
def redis_server_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., RedisServer]]:
    """``make(*extra_args)``: a private, started server, stopped after the test."""
    require_redis()
    made: list[RedisServer] = []

    def make(
        *extra_args: str, password: str | None = None, tls: ServerTLS | None = None
    ) -> RedisServer:
        server = RedisServer(
            tmp_path_factory.mktemp("redis-private"),
            extra_args=extra_args,
            password=password,
            tls=tls,
        )
        made.append(server)
        server.start()
        return server

    try:
        yield make
    finally:
        for server in made:
            server.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """Three masters for the whole session; prefer ``clean_redis_cluster`` in tests."""
    require_redis()
    with RedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture
def clean_redis_cluster(redis_cluster: RedisCluster) -> RedisCluster:
    """The session cluster, every master running (a test may have stopped one) and flushed."""
    redis_cluster.start()
    redis_cluster.flushall()
    return redis_cluster


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a throwaway PKI: ``ca`` signed the server's and the client's
    certificates (both for ``127.0.0.1``); ``stranger_ca`` signed neither."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_ca: Path

    def server(self, *, client_certs: bool = False) -> ServerTLS:
        return ServerTLS(self.server_cert, self.server_key, self.ca, client_certs=client_certs)


def _openssl(directory: Path, *args: str) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *args], cwd=directory, check=True, capture_output=True, timeout=60)


def _make_ca(directory: Path, name: str) -> None:
    _openssl(
        directory,
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout", f"{name}.key", "-out", f"{name}.crt",
    )  # fmt: skip


def _make_leaf(directory: Path, name: str, ca: str) -> None:
    (directory / f"{name}.ext").write_text(
        "subjectAltName=IP:127.0.0.1\n"
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        directory,
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.csr",
    )  # fmt: skip
    _openssl(
        directory,
        "x509", "-req", "-in", f"{name}.csr", "-days", "2",
        "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
        "-extfile", f"{name}.ext", "-out", f"{name}.crt",
    )  # fmt: skip


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """A CA, a server and a client certificate it signed, and an unrelated CA."""
    if OPENSSL is None:
        pytest.fail("openssl must be on the PATH to make the TLS tests' certificates")
    directory = tmp_path_factory.mktemp("tls")
    _make_ca(directory, "ca")
    _make_ca(directory, "stranger")
    _make_leaf(directory, "server", "ca")
    _make_leaf(directory, "client", "ca")
    return TLSFiles(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
        stranger_ca=directory / "stranger.crt",
    )


@pytest.fixture(scope="session")
def _secure_cluster(
    tmp_path_factory: pytest.TempPathFactory, tls_files: TLSFiles
) -> Iterator[RedisCluster]:
    require_redis()
    with RedisCluster(
        tmp_path_factory.mktemp("redis-secure-cluster"),
        password=CLUSTER_PASSWORD,
        tls=tls_files.server(),
    ) as cluster:
        yield cluster


@pytest.fixture
def secure_redis_cluster(_secure_cluster: RedisCluster) -> RedisCluster:
    """The password-and-TLS cluster, every master running and flushed."""
    _secure_cluster.start()
    _secure_cluster.flushall()
    return _secure_cluster
