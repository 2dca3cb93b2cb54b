"""Store configuration: sizes, the embedded default, TOML files and env overrides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.config import default_cache_dir, parse_size
from kvstore.errors import ConfigError
from kvstore.kinds import TierKind
from kvstore.store.config import StoreConfig, apply_env_overrides
from kvstore.tiers.registry import TierConfig

GiB = 2**30
MiB = 2**20

FULL_TOML = """
promote_on_hit = false
max_batch_chunks = 128
scan_on_open = false

[tiers.hbm]
capacity = "2GiB"
device = "cpu"

[tiers.dram]
capacity = "4GiB"
codec = "none"
prefault = true

[tiers.ssd]
path = "{path}"
capacity = "64GiB"
map_size = "80GiB"
codec = "zstd-byteplane:1"
sync = false

[tiers.redis]
nodes = ["127.0.0.1:7000", "127.0.0.1:7001"]
cluster = true
capacity = "16GiB"
ttl_s = 86400
key_prefix = "kv"
socket_timeout_s = 0.25
"""


def write(tmp_path: Path, text: str, name: str = "kvstore.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- parse_size --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("0", 0),
        ("4096", 4096),
        ("4096B", 4096),
        ("1KB", 1000),
        ("1KiB", 1024),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * MiB),
        ("4GB", 4 * 10**9),
        ("4GiB", 4 * GiB),
        ("2TB", 2 * 10**12),
        ("2TiB", 2 * 2**40),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5KiB", 512),
        ("4gib", 4 * GiB),
        ("4 GiB", 4 * GiB),
        ("  64MiB  ", 64 * MiB),
        ("1mb", 10**6),
    ],
)
def test_parse_size(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "GiB",
        "4 G",
        "4GiBs",
        "four GiB",
        "-1GiB",
        "1e9",
        "4 GiB extra",
        "1,5GiB",
        "0x10",
        "4PiB",
    ],
)
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ConfigError, match="cannot parse size"):
        parse_size(text)


# --- the embedded default ----------------------------------------------------------------


def test_embedded_default_is_dram_and_ssd_under_xdg_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "kvstore"
    config = StoreConfig.embedded_default()
    assert [tier.kind for tier in config.tiers] == [TierKind.DRAM, TierKind.SSD]
    dram, ssd = config.tiers
    assert dram.capacity_bytes == 2 * GiB
    assert ssd.capacity_bytes == 32 * GiB
    assert ssd.path == tmp_path / "xdg" / "kvstore" / "lmdb"
    assert config.data_dir == tmp_path / "xdg" / "kvstore"
    assert config.tier(TierKind.REDIS) is None
    assert config.tier(TierKind.HBM) is None
    assert config.promote_on_hit is True


def test_embedded_default_falls_back_to_home_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "kvstore"
    config = StoreConfig.embedded_default()
    assert config.tier(TierKind.SSD).path == tmp_path / ".cache" / "kvstore" / "lmdb"  # type: ignore[union-attr]


def test_embedded_default_with_explicit_data_dir(tmp_path: Path) -> None:
    config = StoreConfig.embedded_default(data_dir=tmp_path / "data")
    assert config.data_dir == tmp_path / "data"
    assert config.tier(TierKind.SSD).path == tmp_path / "data" / "lmdb"  # type: ignore[union-attr]


def test_from_env_with_no_variables_is_the_embedded_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert StoreConfig.from_env(environ={}) == StoreConfig.embedded_default()


# --- TOML files --------------------------------------------------------------------------


def test_toml_with_every_tier_kind(tmp_path: Path) -> None:
    ssd_dir = tmp_path / "lmdb"
    config = StoreConfig.from_toml(write(tmp_path, FULL_TOML.format(path=ssd_dir)))
    assert config.promote_on_hit is False
    assert config.max_batch_chunks == 128
    assert config.scan_on_open is False
    assert [tier.kind for tier in config.tiers] == list(TierKind)
    hbm, dram, ssd, redis = config.tiers
    assert hbm == TierConfig(TierKind.HBM, 2 * GiB, device="cpu")
    assert dram == TierConfig(TierKind.DRAM, 4 * GiB, codec="none", prefault=True)
    assert ssd == TierConfig(
        TierKind.SSD,
        64 * GiB,
        codec="zstd-byteplane:1",
        path=ssd_dir,
        map_size_bytes=80 * GiB,
        sync=False,
    )
    assert redis == TierConfig(
        TierKind.REDIS,
        16 * GiB,
        nodes=("127.0.0.1:7000", "127.0.0.1:7001"),
        cluster=True,
        ttl_s=86400,
        key_prefix="kv",
        socket_timeout_s=0.25,
    )
    assert config.tier(TierKind.SSD) is ssd


def test_a_tier_switch_must_be_a_boolean(tmp_path: Path) -> None:
    text = '[tiers.dram]\ncapacity = "1MiB"\nprefault = "yes"\n'
    with pytest.raises(ConfigError, match="prefault must be true or false"):
        StoreConfig.from_toml(write(tmp_path, text))


def test_toml_tiers_get_default_capacities(tmp_path: Path) -> None:
    text = '[tiers.redis]\nurl = "redis://127.0.0.1:6380/0"\n[tiers.dram]\n[tiers.ssd]\n'
    config = StoreConfig.from_toml(write(tmp_path, text))
    assert [(t.kind, t.capacity_bytes) for t in config.tiers] == [
        (TierKind.DRAM, 2 * GiB),
        (TierKind.SSD, 32 * GiB),
        (TierKind.REDIS, 8 * GiB),
    ]
    assert config.tier(TierKind.REDIS).url == "redis://127.0.0.1:6380/0"  # type: ignore[union-attr]


def test_toml_without_tiers_is_the_embedded_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    config = StoreConfig.from_toml(write(tmp_path, "promote_on_hit = false\n"))
    assert [tier.kind for tier in config.tiers] == [TierKind.DRAM, TierKind.SSD]
    assert config.promote_on_hit is False


def test_toml_data_dir_and_home_expansion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    text = 'data_dir = "~/store"\n[tiers.ssd]\n[tiers.dram]\n[tiers.hbm]\ncapacity = "1GiB"\n'
    config = StoreConfig.from_toml(write(tmp_path, text))
    assert config.data_dir == tmp_path / "store"
    assert config.tier(TierKind.SSD).path == tmp_path / "store" / "lmdb"  # type: ignore[union-attr]
    text = '[tiers.ssd]\npath = "~/elsewhere"\n'
    config = StoreConfig.from_toml(write(tmp_path, text))
    assert config.tier(TierKind.SSD).path == tmp_path / "elsewhere"  # type: ignore[union-attr]


def test_tiers_are_sorted_fastest_first(tmp_path: Path) -> None:
    text = (
        '[tiers.redis]\nurl = "redis://h"\n[tiers.ssd]\n[tiers.dram]\n'
        '[tiers.hbm]\ncapacity = "1GiB"\n'
    )
    config = StoreConfig.from_toml(write(tmp_path, text))
    assert [tier.kind for tier in config.tiers] == [
        TierKind.HBM,
        TierKind.DRAM,
        TierKind.SSD,
        TierKind.REDIS,
    ]
    direct = StoreConfig(
        tiers=(TierConfig(TierKind.REDIS, 1, url="redis://h"), TierConfig(TierKind.DRAM, 1))
    )
    assert [tier.kind for tier in direct.tiers] == [TierKind.DRAM, TierKind.REDIS]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("colour = 'blue'\n", "unknown store setting"),
        ("[tiers.nvme]\n", "unknown tier"),
        ("[tiers.gpu]\ncapacity = '1GiB'\n", "unknown tier"),
        ("[tiers.dram]\ncolour = 'blue'\n", "unknown setting"),
        ("[tiers.dram]\ncapacity_bytes = 10\n", "unknown setting"),
        ("[tiers.dram]\nkind = 'ssd'\n", "unknown setting"),
        ("[tiers.redis]\ncapacity = '1GiB'\n", "redis tier needs a url"),
        ("[tiers.redis]\nurl = ''\n", "redis tier needs a url"),
        ("[tiers.hbm]\ndevice = 'cpu'\n", "needs a capacity"),
        ("[tiers.dram]\ncapacity = '0'\n", "positive capacity"),
        ("[tiers.dram]\ncapacity = 0\n", "positive capacity"),
        ("[tiers.dram]\ncapacity = 'lots'\n", "cannot parse size"),
        ("[tiers.ssd]\nmap_size = 'huge'\n", "cannot parse size"),
        ("[tiers]\n", "at least one tier"),
        ("[tiers.dram]\n[tiers.DRAM]\n", "appear once"),
        ("this is = = not toml\n", "cannot read config"),
        ("[tiers.dram\n", "cannot read config"),
    ],
)
def test_bad_toml_raises_config_error(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        StoreConfig.from_toml(write(tmp_path, text))


def test_missing_file_raises_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        StoreConfig.from_toml(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="cannot read config"):
        StoreConfig.from_toml(tmp_path)  # a directory


def test_duplicate_kinds_are_rejected() -> None:
    with pytest.raises(ConfigError, match="appear once"):
        StoreConfig(tiers=(TierConfig(TierKind.DRAM, 1), TierConfig(TierKind.DRAM, 2)))
    with pytest.raises(ConfigError, match="at least one tier"):
        StoreConfig(tiers=())


# --- environment overrides ---------------------------------------------------------------


def test_env_overrides_file(tmp_path: Path) -> None:
    text = f'[tiers.dram]\ncapacity = "1GiB"\n[tiers.ssd]\npath = "{tmp_path / "db"}"\n'
    path = write(tmp_path, text)
    config = StoreConfig.from_env(
        environ={
            "KVSTORE_CONFIG": str(path),
            "KVSTORE_DRAM_CAPACITY": "8GiB",
            "KVSTORE_REDIS_URL": "redis://127.0.0.1:6380/0",
            "KVSTORE_REDIS_TTL_S": "3600",
            "KVSTORE_PROMOTE_ON_HIT": "false",
            "KVSTORE_MAX_BATCH_CHUNKS": "64",
            "UNRELATED": "ignored",
        }
    )
    assert [tier.kind for tier in config.tiers] == [TierKind.DRAM, TierKind.SSD, TierKind.REDIS]
    assert config.tier(TierKind.DRAM).capacity_bytes == 8 * GiB  # type: ignore[union-attr]
    assert config.tier(TierKind.SSD).path == tmp_path / "db"  # type: ignore[union-attr]
    redis = config.tier(TierKind.REDIS)
    assert redis == TierConfig(TierKind.REDIS, 8 * GiB, url="redis://127.0.0.1:6380/0", ttl_s=3600)
    assert config.promote_on_hit is False
    assert config.max_batch_chunks == 64


def test_env_without_file_adds_to_the_embedded_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = StoreConfig.from_env(
        environ={"KVSTORE_REDIS_URL": "redis://r", "KVSTORE_SSD_SYNC": "no"}
    )
    assert [tier.kind for tier in config.tiers] == [TierKind.DRAM, TierKind.SSD, TierKind.REDIS]
    assert config.tier(TierKind.SSD).sync is False  # type: ignore[union-attr]
    assert config.tier(TierKind.SSD).path == tmp_path / "kvstore" / "lmdb"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("YES", True), ("on", True), ("false", False), ("No", False), ("off", False)],
)
def test_env_booleans(value: str, expected: bool) -> None:
    config = StoreConfig.from_env(
        environ={"KVSTORE_PROMOTE_ON_HIT": value, "KVSTORE_DRAM_CAPACITY": "1MiB"}
    )
    assert config.promote_on_hit is expected


def test_apply_env_overrides_leaves_input_untouched() -> None:
    data = {"promote_on_hit": True, "tiers": {"dram": {"capacity": "1GiB"}}}
    merged = apply_env_overrides(data, {"KVSTORE_DRAM_CAPACITY": "2GiB", "KVSTORE_CONFIG": "x"})
    assert merged == {"promote_on_hit": True, "tiers": {"dram": {"capacity": "2GiB"}}}
    assert data == {"promote_on_hit": True, "tiers": {"dram": {"capacity": "1GiB"}}}


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({"KVSTORE_COLOUR": "blue"}, "unknown store setting"),
        ({"KVSTORE_DRAM_COLOUR": "blue"}, "unknown setting"),
        ({"KVSTORE_DRAM_CAPACITY": "lots"}, "cannot parse size"),
        ({"KVSTORE_REDIS_TTL_S": "60"}, "redis tier needs a url"),
        ({"KVSTORE_HBM_DEVICE": "cpu"}, "needs a capacity"),
    ],
)
def test_bad_env_raises_config_error(environ: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        StoreConfig.from_env(environ=environ)


def test_bad_config_file_named_by_env(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KVSTORE_CONFIG"):
        StoreConfig.from_env(environ={"KVSTORE_CONFIG": str(tmp_path / "absent.toml")})
    bad = write(tmp_path, "[tiers.dram\n")
    with pytest.raises(ConfigError, match="KVSTORE_CONFIG"):
        StoreConfig.from_env(environ={"KVSTORE_CONFIG": str(bad)})


def test_from_env_reads_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVSTORE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("KVSTORE_DRAM_CAPACITY", "3MiB")
    config = StoreConfig.from_env()
    assert config.tier(TierKind.DRAM).capacity_bytes == 3 * MiB  # type: ignore[union-attr]


@pytest.mark.parametrize("text", ["2.01KB", "4.02KB", "8.03KB"])
def test_decimal_sizes_are_exact(text: str) -> None:
    assert parse_size(text) == round(float(text[:-2]) * 1000)


def test_env_redis_nodes() -> None:
    config = StoreConfig.from_env(
        environ={
            "KVSTORE_REDIS_NODES": "127.0.0.1:7000,127.0.0.1:7001",
            "KVSTORE_REDIS_CLUSTER": "1",
        }
    )
    assert config.tier(TierKind.REDIS).nodes == ("127.0.0.1:7000", "127.0.0.1:7001")  # type: ignore[union-attr]


def test_env_float_values() -> None:
    config = StoreConfig.from_env(
        environ={"KVSTORE_REDIS_URL": "redis://r", "KVSTORE_REDIS_SOCKET_TIMEOUT_S": "0.5"}
    )
    assert config.tier(TierKind.REDIS).socket_timeout_s == 0.5  # type: ignore[union-attr]


@pytest.mark.parametrize("text", ['tiers = "dram"\n', "[tiers]\ndram = 5\n"])
def test_malformed_tier_tables_raise_config_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError):
        StoreConfig.from_toml(write(tmp_path, text))


# --- redis credentials and TLS -----------------------------------------------------------


def test_redis_credentials_leave_the_url_for_fields_that_repr_hides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ca.pem").write_text("a CA bundle\n")
    text = (
        '[tiers.redis]\nurl = "rediss://kv-user:p%40ss@cache.internal:6380/0"\n'
        'tls_ca_file = "~/ca.pem"\n'
    )
    config = StoreConfig.from_toml(write(tmp_path, text))
    redis = config.tier(TierKind.REDIS)
    assert redis is not None
    assert redis.url == "rediss://cache.internal:6380/0"
    assert (redis.username, redis.password, redis.tls) == ("kv-user", "p@ss", True)
    assert redis.tls_ca_file == tmp_path / "ca.pem"
    assert "p@ss" not in repr(config) and "p%40ss" not in repr(config)
    nodes = TierConfig(TierKind.REDIS, 1, nodes=("redis://:pw@h:1", "h:2"), cluster=True)
    assert (nodes.nodes, nodes.password) == (("redis://h:1", "h:2"), "pw")
    assert "pw" not in repr(nodes)


def test_redis_password_and_tls_from_the_environment() -> None:
    config = StoreConfig.from_env(
        environ={
            "KVSTORE_REDIS_NODES": "10.0.0.1:7000,10.0.0.2:7000",
            "KVSTORE_REDIS_CLUSTER": "1",
            "KVSTORE_REDIS_USERNAME": "kv-user",
            "KVSTORE_REDIS_PASSWORD": "from-a-secret-store",
            "KVSTORE_REDIS_TLS": "yes",
            "KVSTORE_REDIS_TLS_CA_FILE": __file__,  # any file that exists
        }
    )
    redis = config.tier(TierKind.REDIS)
    assert redis is not None
    assert redis.redis_access().password == "from-a-secret-store"
    assert (redis.username, redis.tls, redis.tls_ca_file) == ("kv-user", True, Path(__file__))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('url = "redis://:a@h/0"\npassword = "b"\n', "password differs"),
        ('url = "redis://h/0"\ntls = true\n', "a URL says redis://"),
        ('url = "redis://h/0"\ntls_ca_file = "/ca.pem"\n', "TLS is off"),
        ('url = "rediss://h/0"\ntls_ca_file = "/no/such/ca.pem"\n', "is not a file"),
        ('url = "rediss://h/0"\ntls = "yes"\n', "tls must be true or false"),
    ],
)
def test_redis_access_that_cannot_work_is_a_config_error(
    tmp_path: Path, text: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        StoreConfig.from_toml(write(tmp_path, "[tiers.redis]\n" + text))
