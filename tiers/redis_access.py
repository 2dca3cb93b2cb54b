"""How a Redis tier reaches its server: node addresses, credentials and TLS.

A tier names its server by URL (standalone) or by node list (cluster), and
may also carry credentials and TLS files as settings of their own. Both forms
are accepted and must agree::

    redis://host:6379/0                      plaintext, no AUTH
    redis://:secret@host:6379/0              AUTH secret (the "default" user)
    rediss://kv:secret@host:6380/0           TLS, AUTH kv secret (an ACL user)
    host:6379                                a bare node: TLS and AUTH from the settings

    username, password                       AUTH (ACL user when username is set)
    tls                                      TLS for bare nodes (``rediss://`` implies it)
    tls_ca_file                              CA bundle that verifies the server certificate
    tls_cert_file, tls_key_file              a client certificate, for servers that want one

Rules, all checked before anything connects (``ConfigError``):

* one tier, one identity: every node of a cluster authenticates the same
  way (redis-py gives one set of credentials to every node it discovers), so
  credentials in several URLs must be equal, and equal to the settings when
  both are given; a ``redis://`` node in a TLS tier is refused rather than
  silently upgraded or downgraded;
* TLS files without TLS, a key without its certificate, or a file that is
  not there are mistakes, not options to ignore;
* the server certificate is always verified (against ``tls_ca_file``, else
  the system CAs), hostname included: a cache that trusts any server would
  take blocks from anyone who can answer on the port.

Secrets stay out of sight: ``RedisAccess.password`` is left out of its repr,
``split_url`` hands back URLs with the credentials removed (what a config
keeps and shows), and ``redact`` masks them in error messages.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError

_PLAIN_SCHEMES = frozenset({"redis", "unix"})
_TLS_SCHEME = "rediss"


@dataclass(frozen=True, slots=True)
class RedisAccess:
    """Credentials and TLS, shared by every node of one tier."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    def check(self) -> None:
        """``ConfigError`` for TLS files that would be ignored, half given, or missing."""
        files = {
            "tls_ca_file": self.tls_ca_file,
            "tls_cert_file": self.tls_cert_file,
            "tls_key_file": self.tls_key_file,
        }
        given = [name for name, path in files.items() if path is not None]
        if given and not self.tls:
            raise ConfigError(
                f"redis {', '.join(given)} set but TLS is off: use rediss:// or tls = true"
            )
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ConfigError("redis tls_key_file needs tls_cert_file (the client certificate)")
        for name in given:
            path = files[name]
            assert path is not None
            if not path.is_file():
                raise ConfigError(f"redis {name} {str(path)!r} is not a file")
        if self.password is None and self.username is not None:
            raise ConfigError("redis username needs a password")

    def client_kwargs(self) -> dict[str, Any]:
        """The redis-py connection arguments for this access (TLS only if ``tls``)."""
        kwargs: dict[str, Any] = {}
        if self.password is not None:
            kwargs["password"] = self.password
        if self.username is not None:
            kwargs["username"] = self.username
        if self.tls:
            kwargs |= {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
            if self.tls_ca_file is not None:
                kwargs["ssl_ca_certs"] = str(self.tls_ca_file)
            if self.tls_cert_file is not None:
                kwargs["ssl_certfile"] = str(self.tls_cert_file)
            if self.tls_key_file is not None:
                kwargs["ssl_keyfile"] = str(self.tls_key_file)
        return kwargs


@dataclass(frozen=True, slots=True)
class _UrlAccess:
    """What one URL says about access: its credentials, and TLS (None: a bare node)."""

    username: str | None
    password: str | None = field(repr=False)
    tls: bool | None


def _parse(text: str) -> tuple[str, _UrlAccess]:
    """``text`` without its ``user:pass@``, and what it said."""
    if "://" not in text:
        return text, _UrlAccess(None, None, None)
    parts = urllib.parse.urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme != _TLS_SCHEME and scheme not in _PLAIN_SCHEMES:
        raise ConfigError(f"redis URL {redact(text)!r}: scheme must be redis, rediss or unix")
    netloc = parts.netloc.rpartition("@")[2]
    clean = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    username = urllib.parse.unquote(parts.username) if parts.username else None
    password = urllib.parse.unquote(parts.password) if parts.password is not None else None
    return clean, _UrlAccess(username, password, scheme == _TLS_SCHEME)


def _agree(name: str, values: Sequence[Any]) -> Any:
    """The one value every source that gives ``name`` gives; ``ConfigError`` if two differ.
    The values themselves never reach the message: they may be secrets."""
    given = {value for value in values if value is not None}
    if len(given) > 1:
        raise ConfigError(f"redis {name} differs between the URL(s) and the settings")
    return given.pop() if given else None


def split_url(urls: Sequence[str], settings: RedisAccess) -> tuple[list[str], RedisAccess]:
    """``urls`` without credentials, and the access they and ``settings`` agree on."""
    parsed = [_parse(url) for url in urls]
    said = [access for _, access in parsed]
    tls = settings.tls or any(access.tls for access in said)
    if tls and any(access.tls is False for access in said):
        raise ConfigError("redis TLS is on (rediss:// or tls = true) but a URL says redis://")
    access = replace(
        settings,
        username=_agree("username", [settings.username, *(a.username for a in said)]),
        password=_agree("password", [settings.password, *(a.password for a in said)]),
        tls=tls,
    )
    return [clean for clean, _ in parsed], access


def host_port(node: str) -> tuple[str, int]:
    """``"host:port"`` or ``"redis[s]://[user:pass@]host:port[/db]"`` -> ``(host, port)``."""
    address = node.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"redis node {redact(node)!r} is not host:port or redis[s]://host:port")
    return host.strip("[]"), int(port)


def redact(text: str) -> str:
    """``text`` with the ``user:password@`` of a URL masked, for messages."""
    scheme, sep, rest = text.partition("://")
    credentials, at, address = rest.rpartition("@")
    if not sep or not at:
        return text
    return f"{scheme}://***@{address}"
