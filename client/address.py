"""Where a client connects: the URL forms ``connect`` accepts, parsed once.

::

    unix:///run/kvstore/kvstore.sock     the daemon's Unix socket (no token; shm possible)
    http://127.0.0.1:8470                the daemon over TCP (bearer token required)
    embedded://                          an in-process store, configured from the environment
    embedded:///etc/kvstore/store.toml   an in-process store from a TOML file

An engine integration (vLLM's connector, SGLang's storage backend) that is not
given a URL connects to ``$KVSTORE_URL``, else to the daemon's default socket
(``engine_url``).
"""

from __future__ import annotations

import enum
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import ConfigError

TOKEN_ENV = "KVSTORE_AUTH_TOKEN"
URL_ENV = "KVSTORE_URL"
DEFAULT_URL = f"unix://{Path.home() / '.cache' / 'kvstore' / 'kvstore.sock'}"


class Scheme(enum.Enum):
    UNIX = "unix"
    HTTP = "http"
    EMBEDDED = "embedded"


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed store URL. ``path`` is the socket (unix) or the config file (embedded,
    ``None`` for the environment's config); ``base_url`` is what httpx sends to."""

    scheme: Scheme
    base_url: str
    path: str | None = None

    @classmethod
    def parse(cls, url: str) -> Address:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme == Scheme.UNIX.value:
            if parts.netloc or not parts.path:
                raise ConfigError(f"{url!r}: expected unix:///absolute/path/to/socket")
            # The host is only the HTTP Host header; the socket picks the daemon.
            return cls(Scheme.UNIX, "http://kvstore", parts.path)
        if parts.scheme == Scheme.HTTP.value:
            if not parts.hostname or parts.path not in ("", "/"):
                raise ConfigError(f"{url!r}: expected http://host:port")
            return cls(Scheme.HTTP, f"http://{parts.netloc}")
        if parts.scheme == Scheme.EMBEDDED.value:
            if parts.netloc:
                raise ConfigError(f"{url!r}: expected embedded:// or embedded:///path/to/config")
            return cls(Scheme.EMBEDDED, url, parts.path or None)
        raise ConfigError(f"{url!r}: the scheme must be unix://, http:// or embedded://")


def bearer_token(address: Address, token: str | None) -> str | None:
    """The token to send: the argument, else ``$KVSTORE_AUTH_TOKEN``; TCP only, since
    the Unix socket is guarded by its file mode instead."""
    if address.scheme is not Scheme.HTTP:
        return None
    return token if token is not None else os.environ.get(TOKEN_ENV) or None


def engine_url(configured: str | None) -> str:
    """The URL an engine integration connects to: its own setting, else ``$KVSTORE_URL``,
    else the daemon's default socket."""
    return configured or os.environ.get(URL_ENV) or DEFAULT_URL
