"""/openapi.json describes exactly the routes the app serves."""

from __future__ import annotations

from aiohttp import web

from chronomq.cluster.httpapi.api import add_routes
from chronomq.cluster.httpapi.openapi import ROUTES, spec


def served_routes() -> set[tuple[str, str]]:
    app = web.Application()
    add_routes(app)
    out = set()
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter")
        out.add((route.method, path))
    return out


def test_spec_lists_every_route_and_nothing_else() -> None:
    assert set(ROUTES) == served_routes()


def test_spec_is_openapi_with_errors_on_every_operation() -> None:
    doc = spec()
    assert doc["openapi"].startswith("3.")
    ops = [op for item in doc["paths"].values() for op in item.values()]
    assert len(ops) == len(ROUTES)
    for op in ops:
        assert "4XX" in op["responses"] and op["summary"]


def test_spec_documents_the_bearer_token_and_the_open_routes() -> None:
    for metrics_public in (False, True):
        doc = spec(metrics_public)
        assert doc["components"]["securitySchemes"]["bearerAuth"] == {
            "type": "http",
            "scheme": "bearer",
            "description": doc["components"]["securitySchemes"]["bearerAuth"]["description"],
        }
        assert doc["security"] == [{"bearerAuth": []}]
        open_ops = {
            (method.upper(), path)
            for path, item in doc["paths"].items()
            for method, op in item.items()
            if op.get("security") == []
        }
        expected = {
            ("GET", "/healthz"),
            ("GET", "/readyz"),
            ("GET", "/console"),
            ("GET", "/console/{file}"),
        }
        if metrics_public:
            expected.add(("GET", "/metrics"))
        assert open_ops == expected
        for path, item in doc["paths"].items():
            for method, op in item.items():
                assert ("401" in op["responses"]) == ((method.upper(), path) not in expected)
