"""The routes the web console needs, on 3 real node processes: message lookup by id and by key,
consumer groups with lag, the timer wheel's due histogram, leader changes in the cluster view,
the console's static files and their security headers; bad input answers 4xx naming the field.
Every check waits on a condition with a deadline."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from chronomq.cluster.process.launcher import LocalCluster

pytestmark = pytest.mark.integration

TOKEN = "console-token-0123456789"


def call(
    url: str, method: str = "GET", body: Any = None, token: str | None = None
) -> tuple[int, Any, dict[str, str]]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - our own nodes
            raw, status, got = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as exc:
        raw, status, got = exc.read(), exc.code, dict(exc.headers)
    ctype = got.get("Content-Type", "")
    return status, json.loads(raw) if ctype.startswith("application/json") else raw, got


def until(predicate: Any, what: str, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout_s} s")


def produce(url: str, topic: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    status, body, _ = call(f"{url}/v1/topics/{topic}/messages", "POST", {"messages": messages})
    assert status == 200, body
    results: list[dict[str, Any]] = body["results"]
    return results


def assert_error(answer: tuple[int, Any, dict[str, str]], status: int, field: str | None) -> None:
    got, body, _ = answer
    assert got == status, (got, body)
    assert set(body) >= {"error", "message", "field"}, body
    assert body["field"] == field, body


def test_lookup_groups_histogram_and_cluster_view(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster()
    leader = cluster.wait_leader(60)
    url = cluster.http_url(leader)
    follower = cluster.http_url((leader + 1) % 3)
    assert call(f"{url}/v1/topics/orders", "PUT", {"queues": 2})[0] == 201
    now = int(time.time() * 1000)
    placed = produce(
        url,
        "orders",
        [
            {"body": "plain", "keys": ["k1"], "queue": 0},
            {"body": "level", "keys": ["k1"], "delay_level": 18, "queue": 1},
            {"body": "soon", "keys": ["k1"], "delay_ms": 300, "queue": 1},
            {"body": "later", "keys": ["k2"], "deliver_at_ms": now + 20 * 60_000, "queue": 0},
            {"body": "cancel me", "deliver_at_ms": now + 40 * 60_000, "queue": 0},
            {"body": "fast level", "delay_level": 1, "queue": 0},
        ],
    )
    plain, level, soon, later, doomed, fast = (p["msg_id"] for p in placed)
    status, answer, _ = call(f"{url}/v1/timers/{doomed}", "DELETE")
    assert (status, answer["status"]) == (200, "cancelled"), answer

    def found(node: str, msg_id: str, status: str) -> Any:
        got, body, _ = call(f"{node}/v1/messages/{msg_id}")
        return body if got == 200 and body["status"] == status else None

    # Asked on a follower, from its own replica.
    m = until(lambda: found(follower, plain, "stored"), "plain message on the follower")
    assert m["kind"] == "plain" and m["stored"]["topic"] == "orders" and m["keys"] == ["k1"]
    assert m["stored"]["queue"] == 0 and m["stored"]["offset"] == 0

    m = until(lambda: found(follower, level, "waiting"), "level message waiting")
    assert m["kind"] == "level" and m["delay_level"] == 18 and m["topic"] == "orders"
    assert m["stored"]["topic"] == "SCHEDULE_TOPIC_XXXX" and m["stored"]["queue"] == 17
    assert m["due_ms"] == m["stored"]["store_ms"] + 2 * 3600 * 1000

    m = until(lambda: found(url, soon, "delivered"), "short timer delivered")
    assert m["kind"] == "timer" and m["delivered"]["topic"] == "orders"
    assert m["delivered"]["queue"] == 1 and m["delivered_ms"] >= m["due_ms"]
    assert m["stored"]["topic"] == "rmq_sys_wheel_timer"

    m = until(lambda: found(url, fast, "delivered"), "level-1 message delivered")
    assert m["kind"] == "level" and m["delivered"]["topic"] == "orders"
    assert m["delivered_ms"] >= m["due_ms"]

    m = until(lambda: found(follower, later, "waiting"), "timer waiting in the wheel")
    assert m["due_ms"] == now + 20 * 60_000 and m["wheel_slot_ms"] <= m["due_ms"]
    until(lambda: found(follower, doomed, "cancelled"), "cancelled timer")

    # The topic narrows the search; a wrong topic does not find it.
    assert call(f"{url}/v1/messages/{plain}?topic=orders")[0] == 200
    call(f"{url}/v1/topics/other", "PUT", {"queues": 1})
    assert_error(call(f"{url}/v1/messages/{plain}?topic=other"), 404, "msg_id")

    # By key: the plain message and the delayed ones bound for the topic, each once.
    status, by_key, _ = call(f"{url}/v1/topics/orders/messages?key=k1")
    assert status == 200 and by_key["complete"], by_key
    assert {x["msg_id"] for x in by_key["messages"]} == {plain, level, soon}
    assert call(f"{url}/v1/topics/orders/messages?key=nope")[1]["messages"] == []

    # Groups: offsets, lag, retry and DLQ topics.
    assert (
        call(f"{url}/v1/groups/g1/offsets", "PUT", {"topic": "orders", "queue": 0, "offset": 1})[0]
        == 200
    )
    status, back, _ = call(
        f"{url}/v1/groups/g1/retry", "POST", {"topic": "orders", "queue": 0, "offset": 0}
    )
    assert status == 200 and back["target"] == "retry", back

    def groups_ready() -> Any:
        got, body, _ = call(f"{follower}/v1/groups")
        if got != 200 or not body["groups"] or not body["groups"][0]["retry"]["exists"]:
            return None
        return body

    groups = until(groups_ready, "group g1 with its retry topic on the follower")
    (g1,) = groups["groups"]
    assert g1["group"] == "g1" and g1["dlq"] == {"topic": "%DLQ%g1", "exists": False, "messages": 0}
    topic = call(f"{url}/v1/topics/orders")[1]
    high = next(q["max_offset"] for q in topic["queues"] if q["queue"] == 0)
    assert g1["queues"] == [
        {"topic": "orders", "queue": 0, "offset": 1, "max_offset": high, "lag": high - 1}
    ]
    # The message sent back waits in delay level 3 before it reaches the retry topic.
    assert g1["lag"] == high - 1 and g1["retry"]["topic"] == "%RETRY%g1"
    assert call(f"{url}/v1/groups?after=g1")[1]["groups"] == []

    # The histogram: the two timers of the hour, one of them cancelled.
    status, hist, _ = call(f"{follower}/v1/admin/timer/histogram")
    assert status == 200 and len(hist["buckets"]) == 60 and hist["bucket_ms"] == 60_000
    assert hist["total"] == 2, hist
    assert sum(b["cancels"] for b in hist["buckets"]) == 1
    minute = (now + 20 * 60_000 - hist["from_ms"]) // 60_000
    assert hist["buckets"][minute]["messages"] == 1, hist
    status, small, _ = call(f"{url}/v1/admin/timer/histogram?minutes=30&buckets=3")
    assert status == 200 and small["total"] == 1 and small["bucket_ms"] == 600_000

    # The cluster view carries the leader changes the node saw, with their term.
    view = call(f"{follower}/v1/admin/cluster")[1]
    assert view["leader_changes"][-1]["to"] == leader
    assert view["leader_changes"][-1]["term"] == view["term"]

    # Bad input: 4xx naming the field.
    assert_error(call(f"{url}/v1/messages/not-an-id"), 400, "msg_id")
    assert_error(call(f"{url}/v1/messages/{'0' * 32}"), 404, "msg_id")
    assert_error(call(f"{url}/v1/messages/{plain}?topic=nope"), 404, "topic")
    assert_error(call(f"{url}/v1/messages/{plain}?topic=bad%20name"), 400, "topic")
    assert_error(call(f"{url}/v1/topics/orders/messages"), 400, "key")
    assert_error(call(f"{url}/v1/topics/orders/messages?key=a%20b"), 400, "key")
    assert_error(call(f"{url}/v1/topics/orders/messages?key=k&max=0"), 400, "max")
    assert_error(call(f"{url}/v1/topics/orders/messages?key=k&max=x"), 400, "max")
    assert_error(call(f"{url}/v1/topics/nope/messages?key=k"), 404, "topic")
    assert_error(call(f"{url}/v1/groups?limit=0"), 400, "limit")
    assert_error(call(f"{url}/v1/admin/timer/histogram?minutes=61"), 400, "minutes")
    assert_error(call(f"{url}/v1/admin/timer/histogram?buckets=0"), 400, "buckets")
    assert_error(call(f"{url}/v1/admin/timer/histogram?buckets=many"), 400, "buckets")


def test_console_files_are_served_open_with_security_headers(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(auth_token=TOKEN)
    cluster.wait_leader(60)
    url = cluster.http_url(1)
    status, page, headers = call(f"{url}/console")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'<script type="module" src="/console/app.js">' in page
    csp = headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["Referrer-Policy"] == "no-referrer"
    for name, ctype in (
        ("app.js", "text/javascript"),
        ("view-cluster.js", "text/javascript"),
        ("console.css", "text/css"),
        ("icon.svg", "image/svg+xml"),
    ):
        status, _, headers = call(f"{url}/console/{name}")
        assert status == 200 and headers["Content-Type"].startswith(ctype), name
        assert headers["Content-Security-Policy"] == csp
    # No inline script or style anywhere in the shipped files.
    assert b"<script>" not in page and b"style=" not in page
    # What is no console file needs the token, as any path that matches no route does.
    for bad in ("nope.js", "..%2Fapi.py", "%2e%2e", "api.py", "INDEX.HTML"):
        assert_error(call(f"{url}/console/{bad}"), 401, "Authorization")
        assert_error(call(f"{url}/console/{bad}", token=TOKEN), 404, "file")
    # The page is open; the data is not; healthz tells the page to ask for the token.
    assert call(f"{url}/healthz")[1]["auth_required"] is True
    assert_error(call(f"{url}/v1/groups"), 401, "Authorization")
    assert call(f"{url}/v1/groups", token=TOKEN)[0] == 200
    assert call(f"{url}/console", "POST")[0] == 401
