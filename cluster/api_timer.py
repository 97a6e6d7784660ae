"""HTTP routes of the timer service (arbitrary-time messages)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

# (method, path): (summary, request schema or None, 200 response schema, query parameters)
ROUTES: dict[tuple[str, str], tuple[str, Any, Any, list[str]]] = {}


def add_routes(app: web.Application) -> None:
    """Register the routes of :data:`ROUTES`."""


def install_metrics(app: web.Application) -> None:
    """Add the service's Prometheus metrics to the app's registry."""
