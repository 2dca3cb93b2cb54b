"""The settings file and the environment, read once for every part of kvstore.

One TOML file holds every part's table; each part's settings are a frozen
dataclass that lives with the part (as uvicorn keeps ``Config`` apart from
``Server``)::

    data_dir = "/var/lib/kvstore"         StoreConfig      kvstore.store.config
    promote_on_hit = true                   (store-wide settings, the top level)

    [tiers.dram]                          TierConfig       kvstore.tiers.registry
    capacity = "4GiB"
    prefault = true                       # commit the arena's pages at startup

    [tiers.ssd]                           # LMDB
    path = "~/.cache/kvstore/lmdb"
    capacity = "64GiB"
    codec = "zstd-byteplane:1"

    [tiers.redis]
    url = "rediss://kv@127.0.0.1:6380/0"  # or nodes = ["127.0.0.1:7000", ...], cluster = true
    write = "through"                     # every put copied here (other hosts see it) and
                                          # sized by the servers' maxmemory; "back": only
    capacity = "16GiB"                    # what local tiers push out, within capacity
    password = "..."                      # better KVSTORE_REDIS_PASSWORD; username, an ACL user
    tls_ca_file = "/etc/kvstore/ca.pem"   # rediss:// or tls = true; tls_cert_file, tls_key_file

    [costs]                               CostModel        kvstore.store.config
    recompute_tokens_per_s = 17500
    dram_bytes_per_s = 50e9

    [daemon]                              DaemonConfig     kvstore.server.config
    socket_path = "/run/kvstore/kvstore.sock"

    [predictor]                           PredictorConfig  kvstore.predictor.config
    horizons_s = [60, 600, 3600]

Environment variables override the file: ``KVSTORE_CONFIG`` names the file;
``KVSTORE_<TIER>_<FIELD>`` sets one field of one tier (``KVSTORE_DRAM_CAPACITY=8GiB``;
``KVSTORE_REDIS_URL=redis://...`` adds a Redis tier); ``KVSTORE_<FIELD>`` a
store-wide field (``KVSTORE_PROMOTE_ON_HIT=false``); ``KVSTORE_DAEMON_<FIELD>``
and ``KVSTORE_PREDICTOR_<FIELD>`` one field of those tables; and
``KVSTORE_AUTH_TOKEN`` the daemon's token, so the secret need not sit in the
file. A value from the environment is read by the type of the field it sets
(``env_value``): ``true``/``yes``/``on`` for a switch, digits for a number, a
list for a list, and the text itself for a string, so a token of digits
stays a string.

With no file and no variables the store runs the embedded default: DRAM plus
LMDB under the user's cache directory, no Redis, no GPU.

This module knows how to read (the file, sizes, environment values) and no
table; it imports nothing of kvstore but the error tree. Every setting, with its
default, is listed in ``docs/configuration.md`` (a test holds it to the code).
"""

from __future__ import annotations

import dataclasses
import decimal
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError

CONFIG_VARIABLE = "KVSTORE_CONFIG"
TOKEN_VARIABLE = "KVSTORE_AUTH_TOKEN"

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SWITCHES = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def parse_size(value: int | str) -> int:
    """``"4GiB"``, ``"512MB"``, ``"1.5GiB"`` or a plain integer, as bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"a size must be a number of bytes or a string, not {value!r}")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _UNITS:
        raise ConfigError(f"cannot parse size {value!r} (try '4GiB' or '512MB')")
    # Decimal, not float: "2.01KB" is 2010 bytes, not 2009.
    return int(decimal.Decimal(match.group(1)) * _UNITS[match.group(2).upper()])


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvstore``, else ``~/.cache/kvstore``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvstore"


def expand_path(value: Any) -> Path:
    """A path from the file or the environment, ``~`` expanded."""
    return Path(os.path.expanduser(str(value)))


def read_toml(path: str | Path, *, named_by: str | None = None) -> dict[str, Any]:
    """The settings file at ``path``; ``ConfigError`` if it cannot be read or parsed
    (naming the variable that named the file, if one did)."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as error:
        source = f" (named by {named_by})" if named_by else ""
        raise ConfigError(f"cannot read config {path}{source}: {error}") from error


def read_settings(path: str | Path | None, env: Mapping[str, str]) -> dict[str, Any]:
    """The settings file: ``path``, else the one ``KVSTORE_CONFIG`` names, else none ({})."""
    if path is not None:
        return read_toml(path)
    named = env.get(CONFIG_VARIABLE)
    return read_toml(named, named_by=CONFIG_VARIABLE) if named else {}


def field_kinds(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` and its annotation, as ``env_value`` reads it."""
    return {f.name: str(f.type) for f in dataclasses.fields(cls)}


def env_value(variable: str, text: str, kind: str) -> Any:
    """The value of environment ``variable`` for a field annotated ``kind``, as the
    settings file would hold it (``ConfigError`` if it cannot be one).

    ``bool``: ``1/true/yes/on`` or ``0/false/no/off``; ``int``, ``float``;
    ``tuple[...]``: a TOML list (``[60, 600]``) or comma-separated items;
    ``X | None``: ``none`` or nothing for ``None``; anything else (a string,
    a path, a size such as ``8GiB``) is the text as it is.
    """
    optional = kind.endswith("| None")
    base = kind.removesuffix("| None").strip()
    lowered = text.strip().lower()
    if optional and lowered in ("", "none"):
        return None
    try:
        if base == "bool":
            return _SWITCHES[lowered]
        if base == "int":
            return int(lowered)
        if base == "float":
            return float(lowered)
        if base.startswith("tuple["):
            return _env_list(text, base)
    except (KeyError, ValueError):
        raise ConfigError(f"{variable}={text!r} is not of type {kind}") from None
    return text


def _env_list(text: str, kind: str) -> list[Any]:
    if text.strip().startswith("["):
        try:
            items = tomllib.loads(f"value = {text}")["value"]
        except tomllib.TOMLDecodeError:
            raise ValueError(text) from None
    else:
        items = [item.strip() for item in text.split(",") if item.strip()]
    if kind.startswith("tuple[float"):
        return [float(item) for item in items]
    return [str(item) for item in items]


def env_table(env: Mapping[str, str], prefix: str, kinds: Mapping[str, str]) -> dict[str, Any]:
    """The variables named ``<prefix><FIELD>`` as entries of a table, each read by its
    field's kind (``kinds``; a name not in it stays text, for the table to refuse)."""
    table: dict[str, Any] = {}
    for variable, text in env.items():
        if variable.startswith(prefix) and len(variable) > len(prefix):
            name = variable[len(prefix) :].lower()
            table[name] = env_value(variable, text, kinds.get(name, "str"))
    return table


def check_switch(where: str, value: Any) -> bool:
    """``value`` if it is a boolean; ``ConfigError`` naming ``where`` otherwise."""
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, not {value!r}")
    return value
