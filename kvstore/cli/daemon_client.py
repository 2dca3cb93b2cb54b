"""The command line's way to a running daemon: one JSON request over its Unix socket
or TCP, and every way that can fail turned into one ``CommandFailed`` line.

An operator's command must say what went wrong in one line and exit non-zero,
never print a traceback: a URL without a scheme, a socket nobody listens on, a
daemon that answers with an error body (its code and message are shown), or an
answer that is not JSON.
"""

from __future__ import annotations

from typing import Any

import httpx

from kvstore.errors import KVStoreError
from kvstore.wire.codes import exception_from_body

_SCHEMES = ("unix://", "http://", "https://")


class CommandFailed(KVStoreError):
    """What a command prints (after its name) before exiting with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class DaemonClient:
    """Requests to the daemon at ``url`` (``unix:///path`` or ``http(s)://host:port``)."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 5.0) -> None:
        if not url.startswith(_SCHEMES):
            raise CommandFailed(
                f"{url!r} is not a daemon URL: expected unix:///path/kvstore.sock "
                "or http://host:port",
                exit_code=2,
            )
        self.url = url
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        if url.startswith("unix://"):
            transport = httpx.HTTPTransport(uds=url[len("unix://") :])
            base = "http://kvstore"
        else:
            transport = httpx.HTTPTransport()
            base = url.rstrip("/")
        self._client = httpx.Client(transport=transport, base_url=base, timeout=timeout_s)

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._client.close()

    def get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        return self.request("GET", path, params=params)

    def request(
        self,
        method: str,
        path: str,
        *,
        body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> dict[str, Any]:
        """The JSON object answered to ``method path``; ``CommandFailed`` otherwise.
        ``ok``: the statuses whose body is an answer rather than an error."""
        try:
            response = self._client.request(
                method, path, json=body, params=params, headers=self._headers
            )
        except httpx.HTTPError as error:
            raise CommandFailed(f"{self.url}: {_reason(error)}") from None
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if response.status_code not in ok:
            raise CommandFailed(str(exception_from_body(response.status_code, answer)))
        if not isinstance(answer, dict):
            raise CommandFailed(f"{self.url}{path} answered without a JSON object")
        return answer


def _reason(error: httpx.HTTPError) -> str:
    """httpx's message for a transport failure, or its kind when it has none."""
    text = str(error).strip()
    if isinstance(error, httpx.TimeoutException):
        return f"no answer in time ({text or 'timeout'})"
    if isinstance(error, httpx.ConnectError):
        return f"cannot connect ({text or 'refused'}): is the daemon running?"
    return text or type(error).__name__
