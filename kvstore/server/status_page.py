"""The status page at ``/ui``: three files shipped in the package (``ui/``), no build
step and nothing fetched from elsewhere.

The files hold no data, so they are served without the token; the page's script
reads everything through the API (``/v1/stats``, ``/v1/sessions``,
``/v1/decisions``) under the same auth as any client: over TCP it sends the bearer
token it was given once in the address's fragment (``/ui#token=...``, never sent
to the server, kept in the tab's sessionStorage). A strict Content-Security-Policy
lets the page load nothing but its own files and talk to nothing but its daemon.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

_FILES = {
    "/ui": ("index.html", "text/html"),
    "/ui/status.js": ("status.js", "text/javascript"),
    "/ui/status.css": ("status.css", "text/css"),
}
PAGE_PATHS = frozenset(_FILES)
_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


def add_status_page(app: web.Application) -> None:
    for path in _FILES:
        app.router.add_get(path, status_page_file)


async def status_page_file(request: web.Request) -> web.Response:
    name, content_type = _FILES[request.path]
    text = (resources.files("kvstore.server") / "ui" / name).read_text(encoding="utf-8")
    return web.Response(text=text, content_type=content_type, headers=_HEADERS)
