"""Writes a page on another site could make a browser send, against real nodes: a
``<form enctype="text/plain">`` POST and a ``no-cors`` fetch, by raw HTTP and from Chromium.

A body must be ``application/json`` (415 naming the type given), and a write whose ``Origin`` or
``Sec-Fetch-Site`` says another origin is refused (403), with the token or without; the
console (same origin) keeps working, which ``test_console_browser`` covers view by view."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.test_console_api import call
from tests.integration.test_console_browser import Page, browser  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

TOKEN = "cross-site-token-0123456789"
STOP_ALL = json.dumps({"stop_enqueue": True, "stop_dequeue": True}).encode()
EVIL = "http://evil.example"


def raw(
    url: str, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    """One request exactly as given (no header added but Host and Content-Length)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=15)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def switches(url: str, token: str | None = None) -> dict[str, Any]:
    status, view, _ = call(f"{url}/v1/admin/timer", token=token)
    assert status == 200, view
    return dict(view["switches"])


def messages_in(url: str, topic: str) -> int:
    status, view, _ = call(f"{url}/v1/topics/{topic}")
    if status == 404:
        return 0
    return sum(q["max_offset"] for q in view["queues"])


def test_bodies_must_be_json_and_writes_from_another_origin_are_refused(
    make_cluster: Any,
) -> None:
    cluster: LocalCluster = make_cluster()
    leader = cluster.wait_leader(60)
    cluster.wait_all_know_leader(30)
    follower = cluster.http_url((leader + 1) % 3)
    before = switches(follower)
    produce = json.dumps({"messages": [{"body": "from a form"}]}).encode()

    # What a form or a no-cors fetch can send: text/plain, urlencoded, multipart, or no type.
    for ctype in (
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        None,
    ):
        headers = {} if ctype is None else {"Content-Type": ctype}
        for path, body in (
            ("/v1/topics/formed/messages", produce),
            ("/v1/admin/timer/switches", STOP_ALL),
        ):
            status, answer = raw(follower, "POST", path, body, headers)
            assert status == 415, (ctype, path, answer)
            assert answer["error"] == "unsupported_media_type" and answer["field"] == "Content-Type"
            assert (ctype or "none was given")[:10] in answer["message"], answer
    # A body on a read is refused the same way.
    assert raw(follower, "GET", "/v1/topics", b"x", {"Content-Type": "text/plain"})[0] == 415

    # JSON, but from a page on another origin (which a browser would not even send without
    # asking first; the node refuses it anyway), by Origin or by Sec-Fetch-Site.
    jsonh = {"Content-Type": "application/json"}
    host = urllib.parse.urlsplit(follower).netloc
    for extra in (
        {"Origin": EVIL},
        {"Origin": "null"},
        {"Origin": f"http://{host.split(':')[0]}:1"},  # same host, another port
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Origin": f"http://{host}", "Sec-Fetch-Site": "cross-site"},
    ):
        for method, path, body in (
            ("POST", "/v1/admin/timer/switches", STOP_ALL),
            ("POST", "/v1/topics/formed/messages", produce),
            ("DELETE", "/v1/topics/formed", None),
        ):
            status, answer = raw(follower, method, path, body, {**jsonh, **extra})
            assert status == 403, (extra, path, answer)
            assert answer["error"] == "cross_origin" and answer["field"] == "Origin", answer
    assert switches(follower) == before
    assert messages_in(follower, "formed") == 0

    # The same origin (what the console sends), and clients that send neither header, pass;
    # reads from anywhere answer (a browser keeps the answer from a page on another origin).
    same = {**jsonh, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}
    assert raw(follower, "POST", "/v1/topics/formed/messages", produce, same)[0] == 200
    assert raw(follower, "POST", "/v1/topics/formed/messages", produce, jsonh)[0] == 200
    assert raw(follower, "GET", "/v1/topics", None, {"Origin": EVIL})[0] == 200
    leader_url = cluster.http_url(leader)
    assert raw(leader_url, "POST", "/v1/topics/formed/messages", produce, jsonh)[0] == 200


def test_a_write_from_another_origin_is_refused_with_the_token_too(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(1, auth_token=TOKEN)
    cluster.wait_leader(60)
    url = cluster.http_url(0)
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    status, answer = raw(
        url, "POST", "/v1/admin/timer/switches", STOP_ALL, {**auth, "Origin": EVIL}
    )
    assert status == 403 and answer["error"] == "cross_origin", answer
    status, answer = raw(
        url, "POST", "/v1/admin/timer/switches", STOP_ALL, {**auth, "Content-Type": "text/plain"}
    )
    assert status == 415, answer
    assert switches(url, TOKEN) == {"stop_enqueue": False, "stop_dequeue": False}


ATTACK = """<!doctype html><html><body>
<form id="f" method="POST" enctype="text/plain" action="{node}/v1/topics/phished/messages">
<input name='{{"messages":[{{"body":"x' value='"}}]}}'></form>
<script>
fetch("{node}/v1/admin/timer/switches", {{method: "POST", mode: "no-cors",
  body: JSON.stringify({{stop_enqueue: true, stop_dequeue: true}})}})
  .then(() => {{ document.title = "fetched"; document.getElementById("f").submit(); }},
        () => {{ document.title = "fetched"; document.getElementById("f").submit(); }});
</script></body></html>"""


@contextlib.contextmanager
def attack_site(page: str) -> Iterator[str]:
    """A web server on loopback (another origin than the node's: ``localhost`` and another
    port) that serves ``page``; its URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://localhost:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_page_on_another_site_changes_nothing_in_the_browser(
    make_cluster: Any,
    browser: Any,  # noqa: F811 - the fixture imported above
) -> None:
    """Chromium opens a page of another origin on loopback (so the browser's private-network
    rules let it reach the node) that fires a no-cors fetch and posts a form at the node;
    nothing changes."""
    cluster: LocalCluster = make_cluster(1)
    cluster.wait_leader(60)
    node = cluster.http_url(0)
    before = switches(node)
    tab = Page(browser, node)
    seen: list[tuple[str, int]] = []
    tab.page.on(
        "response", lambda r: seen.append((r.url, r.status)) if r.url.startswith(node) else None
    )
    with attack_site(ATTACK.format(node=node)) as evil:
        tab.page.goto(evil)
        tab.page.wait_for_url(f"{node}/v1/topics/phished/messages", timeout=15_000)
    tab.context.close()
    assert switches(node) == before, "the no-cors fetch changed the timer's switches"
    assert messages_in(node, "phished") == 0, "the form stored a message"
    assert (f"{node}/v1/admin/timer/switches", 415) in seen, (seen, tab.errors)
    assert (f"{node}/v1/topics/phished/messages", 415) in seen, (seen, tab.errors)
