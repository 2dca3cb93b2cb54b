"""RedisTier logging in and speaking TLS, against real redis-server processes.

Each server is private (``redis_server_factory``): one with ``requirepass``, one
with an ACL user, TLS ones with and without client certificates (a throwaway
PKI made by ``openssl``, ``tls_files``), and a three-master cluster with
``requirepass``/``masterauth`` over TLS (``secure_redis_cluster``). A tier that
cannot log in or verify the server is down (``TierUnavailable``, saying why),
never a source of misses that look like an empty cache, and never shows the
password.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import kv
from support.redis_servers import CLUSTER_PASSWORD, TLSFiles
from support.redis_tiers import NS, MakeTier, make_blocks

from kvstore.errors import ConfigError, TierUnavailable
from kvstore.kinds import TierKind
from kvstore.local.redis_cluster import RedisCluster
from kvstore.local.redis_server import RedisServer
from kvstore.store.tiered_store import TieredStore
from kvstore.tiers.redis_access import RedisAccess
from kvstore.tiers.redis_tier import RedisTier
from kvstore.tiers.registry import TierConfig

Factory = Callable[..., RedisServer]
PASSWORD = "s3cret-pass"


def assert_round_trip(tier: RedisTier, n: int = 8) -> None:
    items = make_blocks(NS, n)
    tier.put_many(NS.digest, items)
    values = tier.get_many(NS.digest, [key for key, _ in items])
    assert [None if v is None else bytes(v) for v in values] == [b.to_bytes() for _, b in items]


def assert_refused(tier: RedisTier, match: str) -> None:
    """Every operation fails loudly, saying why, and never shows the password."""
    key = make_blocks(NS, 1)[0][0]
    for call in (
        lambda: tier.get_many(NS.digest, [key]),
        lambda: tier.contains_many(NS.digest, [key]),
        lambda: tier.put_many(NS.digest, make_blocks(NS, 1)),
    ):
        with pytest.raises(TierUnavailable, match=match) as raised:
            call()
        assert PASSWORD not in str(raised.value)


def test_requirepass_from_the_url_or_the_settings(
    redis_server_factory: Factory, make_tier: MakeTier, caplog: pytest.LogCaptureFixture
) -> None:
    server = redis_server_factory(password=PASSWORD)
    address = f"127.0.0.1:{server.port}"

    assert_round_trip(make_tier(f"redis://:{PASSWORD}@{address}/0"))
    assert_round_trip(make_tier(server.url, access=RedisAccess(password=PASSWORD)))
    assert_round_trip(make_tier(address, access=RedisAccess(password=PASSWORD)))

    with caplog.at_level(logging.DEBUG):
        assert_refused(make_tier(server.url), "refused the login")
        assert_refused(make_tier(f"redis://:wrong@{address}/0"), "refused the login")
    assert PASSWORD not in caplog.text
    assert PASSWORD not in repr(RedisAccess(password=PASSWORD))


def test_acl_user_logs_in_and_keeps_to_its_keys(
    redis_server_factory: Factory, make_tier: MakeTier
) -> None:
    # The default user is locked behind another password: only the ACL user gets in,
    # and only to keys under ``kvs:``.
    server = redis_server_factory(
        "--user", "kv-user", "on", f">{PASSWORD}", "~kvs:*", "+@all",
        password="admin-only",
    )  # fmt: skip
    address = f"127.0.0.1:{server.port}"

    assert_round_trip(make_tier(server.url, access=RedisAccess("kv-user", PASSWORD)))
    assert_round_trip(make_tier(f"redis://kv-user:{PASSWORD}@{address}/0"))

    assert_refused(make_tier(server.url, access=RedisAccess("kv-user", "wrong")), "refused")
    assert_refused(make_tier(server.url, access=RedisAccess("nobody", PASSWORD)), "refused")
    outside = make_tier(server.url, key_prefix="other", access=RedisAccess("kv-user", PASSWORD))
    assert_refused(outside, "NoPermissionError")


def test_tls_server_is_verified(
    redis_server_factory: Factory, make_tier: MakeTier, tls_files: TLSFiles
) -> None:
    server = redis_server_factory(tls=tls_files.server())
    assert server.url.startswith("rediss://")
    address = f"127.0.0.1:{server.port}"

    assert_round_trip(make_tier(server.url, access=RedisAccess(tls_ca_file=tls_files.ca)))
    assert_round_trip(make_tier(address, access=RedisAccess(tls=True, tls_ca_file=tls_files.ca)))

    # A server whose certificate the tier cannot verify is down, not trusted.
    stranger = RedisAccess(tls=True, tls_ca_file=tls_files.stranger_ca)
    assert_refused(make_tier(server.url, access=stranger), "certificate verify failed")
    assert_refused(make_tier(server.url), "certificate verify failed")  # the system CAs
    # Plaintext against the TLS port fails quickly; it never reads as an empty cache.
    assert_refused(
        make_tier(f"redis://{address}/0", socket_timeout_s=0.5, connect_timeout_s=0.5),
        "ConnectionError|TimeoutError",
    )


def test_an_acl_user_confined_to_the_prefix_over_tls_shares_a_store(
    redis_server_factory: Factory, tls_files: TLSFiles
) -> None:
    """The shared tier as docs/multihost.md sets it up: TLS with the test's own CA, an
    ACL user whose keys are confined to ``kvs:*``, write-through. Two stores (two
    hosts) share a chain through it; the same user under another prefix is refused."""
    server = redis_server_factory(
        "--user", "kvstore", "on", f">{PASSWORD}", "~kvs:*", "+@all",
        password="admin-only", tls=tls_files.server(),
    )  # fmt: skip
    shared = TierConfig(
        TierKind.REDIS,
        64 << 20,
        url=server.url,
        username="kvstore",
        password=PASSWORD,
        tls_ca_file=tls_files.ca,
        write="through",
    )
    ns = kv.namespace(salt="acl-tls")
    data = kv.chunks(4)
    with (
        TieredStore(kv.config(kv.dram(16), shared)) as host_a,
        TieredStore(kv.config(kv.dram(16), shared)) as host_b,
    ):
        host_a.put(ns, kv.tokens(4), data)
        assert host_a.drain_write_through(time.monotonic() + 10)
        assert host_a.stats().tiers[TierKind.REDIS].write_through_written == 4
        assert host_b.lookup(ns, kv.tokens(4)).tiers == (TierKind.REDIS,) * 4
        kv.assert_chunks_equal(host_b, ns, host_b.keys_for(ns, kv.tokens(4)), data)
    outside = dataclasses.replace(shared, key_prefix="other")
    with TieredStore(kv.config(kv.dram(16), outside)) as stranger:
        stranger.put(ns, kv.tokens(4), data)
        assert stranger.drain_write_through(time.monotonic() + 10)
        counters = stranger.stats().tiers[TierKind.REDIS]
        assert counters.write_through_written == 0 and counters.errors >= 1


def test_tls_with_client_certificates_and_a_password(
    redis_server_factory: Factory, make_tier: MakeTier, tls_files: TLSFiles
) -> None:
    server = redis_server_factory(password=PASSWORD, tls=tls_files.server(client_certs=True))
    access = RedisAccess(password=PASSWORD, tls=True, tls_ca_file=tls_files.ca)

    assert_round_trip(
        make_tier(
            server.url,
            access=RedisAccess(
                password=PASSWORD,
                tls=True,
                tls_ca_file=tls_files.ca,
                tls_cert_file=tls_files.client_cert,
                tls_key_file=tls_files.client_key,
            ),
        )
    )
    assert_refused(make_tier(server.url, access=access), "ConnectionError")  # no certificate


@pytest.mark.cluster
def test_cluster_with_password_and_tls(
    secure_redis_cluster: RedisCluster, make_tier: MakeTier, tls_files: TLSFiles
) -> None:
    nodes = secure_redis_cluster.startup_nodes
    access = RedisAccess(password=CLUSTER_PASSWORD, tls=True, tls_ca_file=tls_files.ca)
    items = make_blocks(NS, 24)
    keys = [key for key, _ in items]

    tier = make_tier(nodes, cluster=True, access=access)
    tier.put_many(NS.digest, items)
    for node in secure_redis_cluster.nodes:  # spread over every master
        assert int(node.command("DBSIZE")[1:].strip()) > 0
    # The same cluster named by URLs that carry the password and the scheme.
    urls = [f"rediss://:{CLUSTER_PASSWORD}@{node}" for node in nodes]
    from_urls = make_tier(urls, cluster=True, access=RedisAccess(tls_ca_file=tls_files.ca))
    values = from_urls.get_many(NS.digest, keys)
    assert [None if v is None else bytes(v) for v in values] == [b.to_bytes() for _, b in items]

    wrong = RedisAccess(password="wrong", tls=True, tls_ca_file=tls_files.ca)
    assert_refused(make_tier(nodes, cluster=True, access=wrong), "refused the login")
    anonymous = RedisAccess(tls=True, tls_ca_file=tls_files.ca)
    assert_refused(make_tier(nodes, cluster=True, access=anonymous), "refused the login")


@pytest.mark.parametrize(
    ("url_or_nodes", "access", "match"),
    [
        ("redis://:a@h:1/0", RedisAccess(password="b"), "password differs"),
        ("redis://u:a@h:1/0", RedisAccess(username="v", password="a"), "username differs"),
        (["redis://:a@h:1", "redis://:b@h:2"], None, "password differs"),
        (["rediss://h:1", "redis://h:2"], None, "a URL says redis://"),
        ("redis://h:1/0", RedisAccess(tls=True), "a URL says redis://"),
        ("h:1", RedisAccess(tls_ca_file=Path("/ca.pem")), "TLS is off"),
        ("rediss://h:1/0", RedisAccess(tls_key_file=Path("/k.pem")), "needs tls_cert_file"),
        ("rediss://h:1/0", RedisAccess(tls_ca_file=Path("/no/such.pem")), "is not a file"),
        ("redis://h:1/0", RedisAccess(username="u"), "username needs a password"),
        ("http://:a@h:1/0", None, "scheme"),
    ],
)
def test_access_that_cannot_work_is_refused_before_connecting(
    url_or_nodes: str | list[str], access: RedisAccess | None, match: str
) -> None:
    cluster = isinstance(url_or_nodes, list)
    with pytest.raises(ConfigError, match=match) as raised:
        RedisTier(url_or_nodes, 1 << 20, cluster=cluster, access=access)
    assert ":a@" not in str(raised.value) and ":b@" not in str(raised.value)
