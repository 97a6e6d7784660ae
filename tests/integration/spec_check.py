"""Every JSON answer an integration test receives, checked against ``/openapi.json``.

:func:`watch` wraps ``aiohttp.ClientSession._request`` for the duration of a test: each answer
from a chronomq route (matched by method and path template) whose content type is JSON is read
and validated against the schema the spec gives for its status (2xx: the route's answer; other
statuses: the error shape, or the route's own schema for that status). Violations are collected
and reported when the test ends, so a test that expects a 4xx still sees it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import aiohttp
import orjson

try:
    import jsonschema_rs
except ImportError:  # the test extra is not installed: nothing is checked
    jsonschema_rs = None

from chronomq.cluster.httpapi.openapi import spec

_Route = tuple[str, re.Pattern[str], dict[str, Any]]


@cache
def _routes() -> list[_Route]:
    doc = spec()
    out: list[_Route] = []
    for path, item in doc["paths"].items():
        pattern = re.compile("^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(path)) + "$")
        for method, op in item.items():
            out.append((method.upper(), pattern, op["responses"]))
    # Literal paths before templated ones (/v1/admin/node before /v1/admin/{...}).
    out.sort(key=lambda r: r[1].pattern.count("[^/]+"))
    return out


@cache
def _validator(schema_json: str) -> Any:
    components = spec()["components"]
    return jsonschema_rs.validator_for(
        {"allOf": [orjson.loads(schema_json)], "components": components}
    )


def _schema_for(method: str, path: str, status: int) -> dict[str, Any] | None:
    for m, pattern, responses in _routes():
        if m == method and pattern.match(path):
            answer = (
                responses.get(str(status))
                or (responses.get("200") if 200 <= status < 300 else None)
                or responses.get(f"{status // 100}XX")
            )
            if answer is None:
                return None
            schema: dict[str, Any] | None = (
                answer.get("content", {}).get("application/json", {}).get("schema")
            )
            return schema
    return None


def violations_of(method: str, path: str, status: int, body: bytes) -> list[str]:
    """What is wrong with an answer, by the spec (empty when it fits or is not described)."""
    if jsonschema_rs is None:
        return []
    schema = _schema_for(method, path, status)
    if schema is None or not body:
        return []
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return [f"{method} {path} -> {status}: not JSON: {body[:200]!r}"]
    validator = _validator(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS).decode())
    return [
        f"{method} {path} -> {status}: {e.message} at {list(e.instance_path)}"
        for e in validator.iter_errors(value)
    ]


@contextlib.contextmanager
def watch() -> Iterator[list[str]]:
    """Collect the spec violations of every answer received meanwhile."""
    found: list[str] = []
    original = aiohttp.ClientSession._request

    async def checked(self: aiohttp.ClientSession, method: str, url: Any, **kw: Any) -> Any:
        resp = await original(self, method, url, **kw)
        if resp.content_type == "application/json" and resp.url.path.startswith(
            ("/v1/", "/healthz", "/readyz")
        ):
            body = await resp.read()  # cached: the test reads it again as usual
            found.extend(violations_of(method.upper(), resp.url.path, resp.status, body))
        return resp

    aiohttp.ClientSession._request = checked  # type: ignore[method-assign]
    try:
        yield found
    finally:
        aiohttp.ClientSession._request = original  # type: ignore[method-assign]
