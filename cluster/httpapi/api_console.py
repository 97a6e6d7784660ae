"""The web console: static files shipped in the package (``cluster/httpapi/console/``), served at
``GET /console`` (the page) and ``GET /console/{file}`` (its modules, style sheet and icon).

No build step and no network: plain ES modules and one style sheet, read once from the package.
The files hold no data and are served without the token; the page asks for the token when the
node has one and sends it with every API call (kept in the tab's ``sessionStorage`` only).
Every answer carries a Content-Security-Policy that allows only this origin's scripts, styles,
images and API (no inline script or style, no framing), and headers that stop sniffing,
referrers and cross-origin embedding.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from typing import Any

from aiohttp import web

from chronomq.cluster.node.errors import ApiError

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Permissions-Policy": "camera=(), microphone=(), geolocation=()",
    "Cache-Control": "no-cache",
}
_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
}
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}\.(?:html|js|css|svg)")
INDEX = "index.html"
MAX_FILES = 64
MAX_FILE_BYTES = 1 << 20

# (method, path): (summary, request schema or None, 200 response schema, query parameters)
ROUTES: dict[tuple[str, str], tuple[str, Any, Any, list[str]]] = {
    ("GET", "/console"): (
        "The web console (an HTML page; open without the token, which the page asks for).",
        None,
        {"type": "string", "format": "html"},
        [],
    ),
    ("GET", "/console/{file}"): (
        "The console's static files: its JavaScript modules, style sheet and icon.",
        None,
        {"type": "string"},
        [],
    ),
}


@functools.cache
def console_files() -> dict[str, tuple[bytes, str]]:
    """The shipped files by name: ``(content, content type)``; read once."""
    root = importlib.resources.files("chronomq.cluster.httpapi") / "console"
    files: dict[str, tuple[bytes, str]] = {}
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if not entry.is_file() or not _NAME.fullmatch(entry.name):
            continue
        data = entry.read_bytes()
        if len(data) > MAX_FILE_BYTES or len(files) >= MAX_FILES:
            raise RuntimeError(f"console file {entry.name} is over the package's limits")
        files[entry.name] = (data, _TYPES[entry.name[entry.name.rindex(".") :]])
    return files


def _serve(name: str) -> web.Response:
    found = console_files().get(name)
    if found is None:
        raise ApiError(404, "not_found", f"the console has no file {name!r}", "file")
    data, content_type = found
    return web.Response(
        body=data, content_type=content_type, charset="utf-8", headers=SECURITY_HEADERS
    )


async def console_page(request: web.Request) -> web.Response:
    return _serve(INDEX)


async def console_file(request: web.Request) -> web.Response:
    return _serve(request.match_info["file"])


def add_routes(app: web.Application) -> None:
    """Register the routes of :data:`ROUTES`."""
    r = app.router
    r.add_get("/console", console_page)
    r.add_get("/console/{file}", console_file)
