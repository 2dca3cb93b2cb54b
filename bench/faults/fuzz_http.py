"""The daemon under fuzz, and one HTTP case sent to it with its answer judged against
docs/http_api.md: a status under 500, an error body of the documented shape, a frames
body that decodes, no success without the token, an answer (or a close) within
``HANG_S``. What is wrong goes to the ``Findings`` with the request as raw bytes."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

import httpx

from faults.campaign import DaemonSpec
from faults.fuzz_driver import Findings
from kvstore.errors import KVStoreError
from kvstore.wire.codes import ErrorCode
from kvstore.wire.frames import FRAMES_CONTENT_TYPE, FrameDecoder

HANG_S = 10.0  # an HTTP request not answered (nor its connection closed) by then hangs
_QUIET_S = 0.25  # a raw request unanswered this long is half-closed: the daemon sees its end


class FuzzedDaemon:
    """The daemon under fuzz and the HTTP clients of both its transports; restarted
    (same data directory) if it dies."""

    def __init__(self, spec: DaemonSpec) -> None:
        self.spec = spec
        self.token = str(spec.daemon["auth_token"])
        self.tcp_url = f"http://127.0.0.1:{spec.daemon['tcp_port']}"
        self.leases: list[str] = []  # granted by shared-memory gets, not yet released
        self._stack = contextlib.ExitStack()
        self._process = spec.process()

    def __enter__(self) -> FuzzedDaemon:
        self._stack.__enter__()
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.__exit__(None, None, None)
        self._process.__exit__()

    def _start(self) -> None:
        self._process.__enter__()
        timeout = httpx.Timeout(HANG_S)
        self.unix = self._stack.enter_context(
            httpx.Client(
                transport=httpx.HTTPTransport(uds=str(self.spec.socket_path)),
                base_url="http://kvstore",
                timeout=timeout,
            )
        )
        self.tcp = self._stack.enter_context(httpx.Client(base_url=self.tcp_url, timeout=timeout))

    def alive(self) -> bool:
        proc = self._process.proc
        return proc is not None and proc.poll() is None

    def restart(self) -> None:
        self._process.__exit__()
        self._process = self.spec.process()
        self._start()

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self._process.log_path.read_text(errors="replace")
        return ""

    def log_tail(self) -> str:
        return self._process.log_tail()


@dataclass(frozen=True)
class HttpCase:
    """One request as httpx sends it. ``credential`` (TCP only): ``right``, ``wrong``
    or ``none``. A ``{lease}`` in ``path`` is replaced by a lease granted earlier."""

    method: str
    path: str
    body: bytes = b""
    content_type: str | None = None
    tcp: bool = False
    credential: str = "right"


class Sender:
    """Sends requests and checks every answer against docs/http_api.md."""

    def __init__(self, daemon: FuzzedDaemon, findings: Findings) -> None:
        self.daemon = daemon
        self.findings = findings

    def send(self, target: str, case: HttpCase) -> None:
        path = case.path
        if "{lease}" in path:
            path = path.replace(
                "{lease}", self.daemon.leases.pop() if self.daemon.leases else "gone"
            )
        headers = {} if case.content_type is None else {"Content-Type": case.content_type}
        if case.tcp and case.credential != "none":
            token = (
                self.daemon.token if case.credential == "right" else self.daemon.token[:-1] + "x"
            )
            headers["Authorization"] = f"Bearer {token}"
        client = self.daemon.tcp if case.tcp else self.daemon.unix
        replay = _as_http(case.method, path, headers, case.body)
        try:
            response = client.request(case.method, path, content=case.body, headers=headers)
        except httpx.TimeoutException:
            self.findings.answered(target, "hang")
            self.findings.record("hangs", target, f"no answer within {HANG_S:g} s", replay)
            return
        except httpx.InvalidURL:
            self.findings.answered(target, "unsendable")  # httpx refuses to send it
            return
        except httpx.TransportError as error:
            # The daemon may close a connection it refused (a put's always closes).
            self.findings.answered(target, f"closed ({type(error).__name__})")
            return
        self.findings.answered(target, str(response.status_code))
        problem = self._problem(case, response)
        if problem is not None:
            kind, detail = problem
            self.findings.record(kind, target, f"{detail}\n{response.text[:2000]}", replay)

    def _problem(self, case: HttpCase, response: httpx.Response) -> tuple[str, str] | None:
        status = response.status_code
        if status >= 500:
            return "http_5xx", f"HTTP {status}"
        unauthenticated = case.tcp and case.credential != "right"
        if unauthenticated and response.is_success and case.path.split("?")[0] != "/healthz":
            return "auth_bypasses", f"HTTP {status} without the token"
        if case.method == "HEAD":
            return None
        kind = response.headers.get("Content-Type", "").split(";")[0]
        if status >= 400:
            if kind == "text/plain" and status in (400, 413, 414, 431):
                return None  # aiohttp's own parser refused it, before any route
            return _error_body_problem(response.content)
        if kind == FRAMES_CONTENT_TYPE:
            return _frames_problem(response.content)
        if kind == "application/json":
            answer = json.loads(response.content)
            if isinstance(answer, dict) and isinstance(answer.get("lease"), str):
                self.daemon.leases.append(answer["lease"])
        return None

    def send_raw(self, target: str, access: tuple[bool, str], request: bytes) -> None:
        tcp, credential = access
        reply, answered = self._exchange(tcp, request)
        if not answered:
            self.findings.answered(target, "hang")
            self.findings.record("hangs", target, f"no answer within {HANG_S:g} s", request)
            return
        match = re.match(rb"HTTP/1\.[01] (\d{3})", reply)
        if match is None:
            self.findings.answered(target, "closed")
            return
        status = int(match.group(1))
        self.findings.answered(target, str(status))
        if status >= 500:
            self.findings.record("http_5xx", target, reply[:2000].decode("latin-1"), request)
        elif tcp and credential != "right" and 200 <= status < 300 and not _open_path(request):
            self.findings.record("auth_bypasses", target, reply[:2000].decode("latin-1"), request)

    def _exchange(self, tcp: bool, request: bytes) -> tuple[bytes, bool]:
        """Write ``request`` on a fresh connection; what came back, and whether the
        daemon answered or closed within ``HANG_S``. A request unanswered after
        ``_QUIET_S`` (a body shorter than its framing says, say) is half-closed, so
        that the daemon sees nothing more is coming; an answer is read until the
        daemon closes or pauses for ``_QUIET_S``."""
        family = socket.AF_INET if tcp else socket.AF_UNIX
        address: Any = (
            ("127.0.0.1", int(self.daemon.spec.daemon["tcp_port"]))
            if tcp
            else str(self.daemon.spec.socket_path)
        )
        until = time.monotonic() + HANG_S
        reply, half_closed = b"", False
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(HANG_S)
            sock.connect(address)
            with contextlib.suppress(OSError):  # refused, and closed before reading it all
                sock.sendall(request)
            while (left := until - time.monotonic()) > 0:
                sock.settimeout(min(left, _QUIET_S) if reply or not half_closed else left)
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    if reply:
                        return reply, True  # answered; the connection is kept open
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_WR)
                    half_closed = True
                    continue
                except OSError:
                    return reply, True  # reset: closed
                if not chunk:
                    return reply, True
                reply += chunk
        return reply, bool(reply)


def _error_body_problem(content: bytes) -> tuple[str, str] | None:
    """Unless ``content`` is the JSON error of docs/http_api.md, what is wrong with it."""
    try:
        body = json.loads(content)
        code, message = body["error"]["code"], body["error"]["message"]
        ErrorCode(code)
    except (ValueError, KeyError, TypeError):
        return "malformed_responses", "an error answer that is not {error: {code, message}}"
    if set(body) != {"error"} or not isinstance(message, str):
        return "malformed_responses", "an error answer with other fields"
    return None


def _frames_problem(content: bytes) -> tuple[str, str] | None:
    """Unless ``content`` is a frames body that decodes, what is wrong with it."""
    decoder = FrameDecoder()
    try:
        decoder.feed(content)
        decoder.finish()
    except KVStoreError as error:
        return "malformed_responses", f"a frames answer that does not decode: {error}"
    return None


def _as_http(method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
    """The request as raw HTTP/1.1 bytes, to replay with ``nc -U``."""
    lines = [f"{method} {path} HTTP/1.1", "Host: kvstore", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogatepass") + body


def _open_path(request: bytes) -> bool:
    """Whether a raw request asks for ``/healthz`` (GET or HEAD), which needs no token."""
    match = re.match(rb"[A-Za-z]+ (\S+)", request)
    return match is not None and match.group(1).split(b"?")[0] == b"/healthz"
