"""The status page (``/ui``) in a real headless Chromium against a real daemon with real
traffic: the tier table, a session with its forecast and placement, a decision, and
the page redrawing itself after a new put."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import kv
from support.browser import CHROMIUM, open_page
from support.daemon import Daemon
from support.http_kv import get_bytes, lookup, make_chain, put, register
from support.predictor_events import OWN_CLOCK, T0, finished, post, processed, started, stats

ARTIFACTS = Path(__file__).resolve().parents[2] / "build" / "test-artifacts"
STORE_TOML = f"""\
data_dir = "{{data_dir}}"

[tiers.dram]
capacity = {64 * kv.ARENA_SLOT}

[tiers.ssd]
capacity = "64MiB"

[predictor]
tick_s = 0.1
"""


def test_the_page_is_served_without_the_token_and_the_data_is_not(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(tcp=True)
    assert daemon.tcp_url is not None
    with httpx.Client(base_url=daemon.tcp_url, timeout=10) as client:
        page = client.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert '<script src="/ui/status.js">' in page.text
        for path, kind in (("/ui/status.js", "text/javascript"), ("/ui/status.css", "text/css")):
            asset = client.get(path)
            assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert client.get("/ui/other.js").status_code == 401  # only the page's own files
        assert client.get("/v1/stats").status_code == 401


NS = kv.namespace(salt="status-page")


def put_chain(client: httpx.Client, n_chunks: int, start: int, session: str | None) -> list[Any]:
    register(client, NS)
    chain = make_chain(NS, n_chunks, start=start)
    assert put(client, chain, session=session) == n_chunks
    return list(chain.keys)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
@pytest.mark.asyncio
async def test_the_page_shows_tiers_sessions_and_decisions_and_redraws(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = daemon_factory(STORE_TOML, daemon=OWN_CLOCK, tcp=True)
    with daemon.client() as client:
        put_chain(client, 4, 0, "alice")
        post(client, started("alice", T0), finished("alice", T0 + 5), started("bob", T0 + 6))
        stats(client, processed(3))
    url = f"{daemon.tcp_url}/ui#token={daemon.token}&refresh=300"
    async with open_page(url, tmp_path / "profile") as page:
        dram = "document.querySelector('#tiers tr[data-tier=\"dram\"]')"
        await page.wait_for(f"{dram} && {dram}.cells[1].textContent === 'up'")
        capacity = f"{64 * kv.ARENA_SLOT / 1024:.1f} KiB"
        assert await page.evaluate(f"{dram}.cells[4].textContent") == capacity
        await page.wait_for("document.getElementById('totals').textContent.includes('stored 4')")

        alice = "document.querySelector('#sessions tr[data-session=\"alice\"]')"
        row = await page.wait_for(f"{alice} && {alice}.innerText")
        assert "idle" in row and "60s: " in row and "10m: " in row  # P(back) per horizon
        assert "dram 4" in row or "ssd 4" in row  # where its chain lies now
        bob = await page.wait_for(
            "document.querySelector('#sessions tr[data-session=\"bob\"]')?.innerText"
        )
        assert "running" in bob
        rows = "[...document.querySelectorAll('#decisions tbody tr')]"
        decided = await page.wait_for(f"{rows}.map(r => r.innerText).join('\\n')")
        assert "alice" in decided
        assert await page.evaluate("document.getElementById('error').hidden") is True

        with daemon.client() as client:
            keys = put_chain(client, 3, 50_000, None)
            assert lookup(client, NS, keys)["num_chunks"] == 3
            assert all(block is not None for block in get_bytes(client, NS, keys)[1])
        await page.wait_for("document.getElementById('totals').textContent.includes('stored 7')")
        # The charts: the lookups' token hit rate and the tier that served the hits. A refresh
        # can land between the lookup and the get, so the tier's share may come one refresh
        # after the hit rate: wait for both rather than for the first drawing.
        legend = "document.getElementById('hit-rate-legend').innerText"
        drawn = await page.wait_for(f"{legend}.includes('dram') && {legend}")
        assert "lookups 100.0%" in drawn and "dram 100.0%" in drawn
        shot = tmp_path / "status_page.png"
        await page.screenshot(shot)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, ARTIFACTS / "status_page.png")
        assert shot.stat().st_size > 10_000

        # Without the token the page says so instead of drawing stale numbers.
        await page.evaluate("sessionStorage.clear()")
        await page.call("Page.navigate", url=f"{daemon.tcp_url}/ui#refresh=300")
        error = "document.getElementById('error')"
        message = await page.wait_for(f"!{error}.hidden && {error}.textContent")
        assert "401" in message
