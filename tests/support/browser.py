"""A real headless Chromium, driven over the DevTools protocol, for the status page's test.

Started with a private profile and ``--remote-debugging-port=0``; the port it
picked is read from ``DevToolsActivePort`` in the profile. ``Page`` evaluates
JavaScript in the page and takes screenshots through one websocket (aiohttp's
client), so the test sees the DOM the page's own script drew, refresh after refresh.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One tab, over its DevTools websocket."""

    def __init__(self, socket: aiohttp.ClientWebSocketResponse) -> None:
        self._socket = socket
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        await self._socket.send_json({"id": ident, "method": method, "params": params})
        while True:
            message = await asyncio.wait_for(self._socket.receive_json(), timeout=30)
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = 20.0) -> Any:
        """The value of ``expression`` once it is truthy; fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"never true within {timeout_s} s: {expression}")
            await asyncio.sleep(0.1)

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def open_page(
    url: str, profile: Path, size: tuple[int, int] = (1400, 1100)
) -> AsyncIterator[Page]:
    """``url`` in a fresh headless Chromium; the browser is killed on exit."""
    assert CHROMIUM is not None
    process = subprocess.Popen(
        [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",  # tests run as root
            "--disable-gpu",
            "--no-first-run",
            f"--window-size={size[0]},{size[1]}",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port = await _devtools_port(profile, process)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = json.loads(await response.text())
            target = next(t for t in targets if t.get("type") == "page")
            async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as socket:
                page = Page(socket)
                await page.call("Page.enable")
                await page.call("Page.navigate", url=url)
                yield page
    finally:
        process.kill()
        process.wait(timeout=10)


async def _devtools_port(profile: Path, process: subprocess.Popen[bytes]) -> int:
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 30
    while not marker.exists() or not marker.read_text().strip():
        if process.poll() is not None:
            raise RuntimeError(f"chromium exited with {process.returncode} while starting")
        if time.monotonic() > deadline:
            raise RuntimeError("chromium did not open its DevTools port within 30 s")
        await asyncio.sleep(0.1)
    return int(marker.read_text().split()[0])
