"""Bad input thrown at a real 3-node cluster: every answer is a 4xx JSON error, nothing is written.

Hypothesis generates malformed JSON, wrong types, oversized bodies, negative and non-integer
offsets, unknown or illegal topics and queues, bad group offsets, bad topic creations and bad
runtime config patches, and sends them to the leader and to the followers (which forward writes).
Every answer must be a 4xx ``{"error", "message", "field"}`` JSON body without a stack trace.
After each batch of examples every node still serves, and the CommitLog digests, topics, group
offsets and effective config are those taken before the batch; no node logged an unexpected error.

Bad configuration files are checked both through ``cluster.config.nodeconfig.load`` (property-based) and by
starting ``python -m cluster node --config FILE``, which must exit non-zero naming the key.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import os
import random
import re
import string
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from chronomq.cluster.config.keys import KEY_BY_NAME, KEYS, RENAMED, Key
from chronomq.cluster.config.nodeconfig import ConfigError, load
from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import dump_logs, free_port_base

pytestmark = pytest.mark.integration

TOPIC = "fuzz"
QUEUES = 4
SEEDED_MESSAGES = 8
MAX_MESSAGE_BYTES = 4096
MAX_REQUEST_BYTES = 65536
MAX_MESSAGES_PER_REQUEST = 20
MAX_PULL_MESSAGES = 1000
MAX_WAIT_MS = 30_000
PEER_IDS = (0, 1, 2)
MESSAGE_FIELDS = frozenset(
    ["body", "body_base64", "keys", "tags", "properties", "queue"]
    + ["delay_level", "delay_ms", "deliver_at_ms"]
)
TOPIC_RE = re.compile(r"[%|a-zA-Z0-9_-]+")
RUNTIME_KEYS = tuple(k for k in KEYS if k.runtime)
STATIC_KEYS = tuple(k for k in KEYS if not k.runtime)

FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.large_base_example,
        HealthCheck.data_too_large,
    ],
)


# ---------------------------------------------------------------------- HTTP


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    content_type: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    base_url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 20.0,
) -> Reply:
    """One request on a fresh connection; ``path`` is sent exactly as given (already quoted)."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout_s)
    try:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        r = conn.getresponse()
        return Reply(r.status, r.getheader("Content-Type", ""), r.read())
    finally:
        conn.close()


def dumps(value: Any) -> bytes:
    """JSON as a client might send it (big integers and all), not as the server would write it."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def assert_api_error(
    reply: Reply, statuses: range | tuple[int, ...] = range(400, 500), field: str | None = None
) -> dict[str, Any]:
    """A 4xx answer with a JSON ``{"error", "message", "field"}`` body and no stack trace."""
    shown = reply.body[:500]
    assert reply.status in statuses, f"status {reply.status}: {shown!r}"
    assert reply.content_type.startswith("application/json"), (reply.content_type, shown)
    assert b"Traceback" not in reply.body, shown
    data = json.loads(reply.body)
    assert isinstance(data, dict), shown
    assert {"error", "message", "field"} <= data.keys(), shown
    assert isinstance(data["error"], str) and data["error"], shown
    assert isinstance(data["message"], str) and data["message"], shown
    assert data["field"] is None or isinstance(data["field"], str), shown
    if field is not None:
        assert data["field"] is not None and data["field"].startswith(field), (field, shown)
    return data


def quote(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")


def leaves_route(segment: str) -> bool:
    """A path segment the router cannot match as a variable ("{", "}", "/", dot segments)."""
    return segment in (".", "..") or any(c in segment for c in "{}/")


# ---------------------------------------------------------------------- the cluster


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What bad input must not change: replicated bytes, topics, offsets, config, logs."""

    digest: tuple[int, str]
    topics: tuple[Any, ...]
    offsets: tuple[Any, ...]
    config: tuple[Any, ...]
    log_sizes: tuple[int, ...]


@dataclass
class FuzzCluster:
    cluster: LocalCluster
    before: Snapshot | None = None

    @property
    def urls(self) -> list[str]:
        return self.cluster.urls

    def _log(self, i: int) -> Path:
        return self.cluster.node_dir(i) / "node.log"

    def snapshot(self) -> Snapshot:
        digest = self.cluster.wait_converged(timeout_s=15)
        return Snapshot(
            digest=(digest["length"], digest["chain"]),
            topics=tuple(call(u, "GET", "/v1/topics").json() for u in self.urls),
            offsets=tuple(
                call(u, "GET", "/v1/groups/fuzz-group/offsets").json() for u in self.urls
            ),
            config=tuple(call(u, "GET", "/v1/admin/config").json() for u in self.urls),
            log_sizes=tuple(self._log(i).stat().st_size for i in range(self.cluster.n)),
        )

    def assert_untouched(self) -> None:
        """Every node still serves, and nothing changed since the test began."""
        assert self.before is not None
        for i, url in enumerate(self.urls):
            assert self.cluster.alive(i), f"node {i} died\n{dump_logs(self.cluster)}"
            assert call(url, "GET", "/healthz").status == 200
            assert call(url, "GET", "/readyz").status == 200
        after = self.snapshot()
        for i in range(self.cluster.n):
            with self._log(i).open("rb") as f:
                f.seek(self.before.log_sizes[i])
                new_lines = f.read().decode(errors="replace").splitlines()
            crashes = [line for line in new_lines if "unexpected error" in line]
            assert not crashes, f"node {i} logged: {crashes[0][:3000]}"
        assert after.digest == self.before.digest, "bad input changed the CommitLog"
        assert after.topics == self.before.topics
        assert after.offsets == self.before.offsets
        assert after.config == self.before.config


def _wait_ready(cluster: LocalCluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if all(call(u, "GET", "/readyz", timeout_s=1).status == 200 for u in cluster.urls):
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"not every node knows the leader within {timeout_s} s")


@pytest.fixture(scope="module")
def running_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzCluster]:
    http_port, raft_port = free_port_base(3, random.Random())
    cluster = LocalCluster(
        3,
        tmp_path_factory.mktemp("fuzz-cluster"),
        http_port=http_port,
        raft_port=raft_port,
        settings={
            "max_request_bytes": MAX_REQUEST_BYTES,
            "max_message_bytes": MAX_MESSAGE_BYTES,
            "max_messages_per_request": MAX_MESSAGES_PER_REQUEST,
            "max_pull_messages": MAX_PULL_MESSAGES,
            "max_wait_ms": MAX_WAIT_MS,
            "log_format": "json",
        },
    )
    try:
        cluster.start()
        leader = cluster.urls[cluster.wait_leader(60)]
        _wait_ready(cluster, 30)
        created = call(leader, "PUT", f"/v1/topics/{TOPIC}", dumps({"queues": QUEUES}))
        assert created.status == 201, created
        batch = {"messages": [{"body": f"seed-{i}", "tags": "t"} for i in range(SEEDED_MESSAGES)]}
        produced = call(leader, "POST", f"/v1/topics/{TOPIC}/messages", dumps(batch))
        assert produced.status == 200, produced
        cluster.wait_converged(timeout_s=30)
        yield FuzzCluster(cluster)
    finally:
        cluster.stop()


@pytest.fixture
def fuzz_cluster(running_cluster: FuzzCluster) -> FuzzCluster:
    """The shared cluster, with a snapshot taken before the test throws anything at it."""
    running_cluster.before = running_cluster.snapshot()
    return running_cluster


# ---------------------------------------------------------------------- strategies

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
not_str = json_values.filter(lambda v: not isinstance(v, str))
not_str_nor_null = not_str.filter(lambda v: v is not None)
not_int = json_values.filter(lambda v: not isinstance(v, int) or isinstance(v, bool))
not_int_nor_null = not_int.filter(lambda v: v is not None)
# Text the broker stores as-is: no lone surrogates, no property separators.
plain_text = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x01\x02"),
    max_size=20,
)
with_separator = st.builds(
    lambda a, sep, b: a + sep + b, plain_text, st.sampled_from("\x01\x02"), plain_text
)

valid_message = st.fixed_dictionaries(
    {"body": plain_text},
    optional={"tags": plain_text, "queue": st.integers(0, QUEUES - 1)},
)
legal_unknown_topic = st.text(
    alphabet=string.ascii_letters + string.digits + "%|_-", min_size=1, max_size=40
).map(lambda s: f"nx-{s}")
illegal_topic = st.one_of(
    st.text(alphabet=st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40).filter(
        lambda s: not TOPIC_RE.fullmatch(s)
    ),
    st.integers(128, 300).map(lambda n: "t" * n),
)


MESSAGE_DEFECTS = (
    "not_object",
    "body_type",
    "body_missing",
    "body_large",
    "b64_type",
    "b64_text",
    "b64_and_body",
    "b64_large",
    "keys_type",
    "keys_item",
    "tags_type",
    "tags_separator",
    "props_type",
    "props_value",
    "props_separator",
    "props_empty_name",
    "props_large",
    "queue_type",
    "queue_negative",
    "queue_unknown",
    "delay_level",
    "delay_ms",
    "deliver_at_ms",
    "two_delays",
    "unknown_field",
)


@st.composite
def bad_message(draw: st.DrawFn, kind: str) -> tuple[Any, int]:
    """A message with exactly the defect ``kind``, and the status it must get."""
    if kind == "not_object":
        return draw(json_values.filter(lambda v: not isinstance(v, dict))), 400
    m: dict[str, Any] = draw(valid_message)
    status = 400
    if kind == "body_type":
        m["body"] = draw(not_str)
    elif kind == "body_missing":
        del m["body"]
    elif kind == "body_large":
        n = draw(st.integers(MAX_MESSAGE_BYTES + 1, MAX_MESSAGE_BYTES * 3))
        m["body"] = draw(st.sampled_from("aé€")) * n
        status = 413
    elif kind == "b64_type":
        del m["body"]
        m["body_base64"] = draw(not_str_nor_null)
    elif kind == "b64_text":
        del m["body"]
        m["body_base64"] = draw(
            st.builds(
                lambda a, c, b: a + c + b,
                st.text(string.ascii_letters, max_size=8),
                st.sampled_from("!*.~ é\n-_"),
                st.text(string.ascii_letters, max_size=8),
            )
        )
    elif kind == "b64_and_body":
        m["body"] = draw(plain_text)
        m["body_base64"] = base64.b64encode(draw(st.binary(max_size=20))).decode()
    elif kind == "b64_large":
        del m["body"]
        n = draw(st.integers(MAX_MESSAGE_BYTES + 1, MAX_MESSAGE_BYTES * 2))
        m["body_base64"] = base64.b64encode(b"\xff" * n).decode()
        status = 413
    elif kind == "keys_type":
        m["keys"] = draw(json_values.filter(lambda v: v is not None and not isinstance(v, list)))
    elif kind == "keys_item":
        bad_key = draw(
            st.one_of(
                not_str,
                st.just(""),
                st.builds(lambda a, b: f"{a} {b}", plain_text, plain_text),
                with_separator,
            )
        )
        good = draw(st.lists(st.text(string.ascii_letters, min_size=1, max_size=5), max_size=2))
        m["keys"] = [*good, bad_key]
    elif kind == "tags_type":
        m["tags"] = draw(not_str_nor_null)
    elif kind == "tags_separator":
        m["tags"] = draw(with_separator)
    elif kind == "props_type":
        m["properties"] = draw(
            json_values.filter(lambda v: v is not None and not isinstance(v, dict))
        )
    elif kind == "props_value":
        m["properties"] = {draw(plain_text.filter(bool)): draw(not_str)}
    elif kind == "props_separator":
        name, value = draw(
            st.one_of(
                st.tuples(with_separator, plain_text),
                st.tuples(plain_text.filter(bool), with_separator),
            )
        )
        m["properties"] = {name: value}
    elif kind == "props_empty_name":
        m["properties"] = {"": draw(plain_text)}
    elif kind == "props_large":
        m["properties"] = {"p": "v" * draw(st.integers(32_768, 40_000))}
    elif kind == "queue_type":
        m["queue"] = draw(not_int_nor_null)
    elif kind == "queue_negative":
        m["queue"] = draw(st.integers(max_value=-1, min_value=-(2**70)))
    elif kind == "queue_unknown":
        m["queue"] = draw(st.integers(QUEUES, 2**70))
    elif kind == "delay_level":
        m["delay_level"] = draw(
            st.one_of(not_int_nor_null, st.integers(max_value=-1, min_value=-(2**63)))
        )
        m.pop("queue", None)
    elif kind in ("delay_ms", "deliver_at_ms"):
        m[kind] = draw(
            st.one_of(
                not_int_nor_null,
                st.integers(max_value=-1, min_value=-(2**63)),
            )
        )
        m.pop("queue", None)
    elif kind == "two_delays":
        names = draw(
            st.lists(
                st.sampled_from(["delay_level", "delay_ms", "deliver_at_ms"]),
                min_size=2,
                max_size=3,
                unique=True,
            )
        )
        for name in names:
            m[name] = draw(st.integers(1, 10))
        m.pop("queue", None)
    elif kind == "unknown_field":
        name = draw(st.text(max_size=12).filter(lambda s: s not in MESSAGE_FIELDS))
        m[name] = draw(json_values)
    else:
        raise AssertionError(kind)
    return m, status


@st.composite
def malformed_produce_body(draw: st.DrawFn, kind: str) -> tuple[bytes, int, str | None]:
    """A produce body wrong as a whole: (bytes, status, expected field prefix or None)."""
    if kind == "bytes":
        return draw(st.binary(max_size=200)), 400, None
    if kind == "truncated":
        whole = dumps({"messages": draw(st.lists(valid_message, min_size=1, max_size=3))})
        return whole[: draw(st.integers(0, len(whole) - 1))], 400, "body"
    if kind == "not_object":
        return dumps(draw(json_values.filter(lambda v: not isinstance(v, dict)))), 400, "body"
    if kind == "messages_type":
        messages = draw(
            st.one_of(
                json_values.filter(lambda v: not isinstance(v, list)),
                st.just([]),
            )
        )
        body: dict[str, Any] = {} if messages is None else {"messages": messages}
        return dumps(body), 400, "messages"
    if kind == "too_many":
        n = draw(st.integers(MAX_MESSAGES_PER_REQUEST + 1, MAX_MESSAGES_PER_REQUEST * 3))
        return dumps({"messages": [{"body": "x"}] * n}), 413, "messages"
    raise AssertionError(kind)


@st.composite
def batch_with_one_bad_message(draw: st.DrawFn, kind: str) -> tuple[bytes, int, str]:
    """Valid messages around one bad one: the whole batch is refused, naming the bad one."""
    before = draw(st.lists(valid_message, max_size=3))
    after = draw(st.lists(valid_message, max_size=3))
    bad, status = draw(bad_message(kind))
    return dumps({"messages": [*before, bad, *after]}), status, f"messages[{len(before)}]"


# ---------------------------------------------------------------------- produce


@pytest.mark.parametrize("kind", ["bytes", "truncated", "not_object", "messages_type", "too_many"])
def test_produce_rejects_malformed_bodies(fuzz_cluster: FuzzCluster, kind: str) -> None:
    @settings(FUZZ, max_examples=30)
    @given(
        url=st.sampled_from(fuzz_cluster.urls),
        case=malformed_produce_body(kind),
        topic=st.one_of(st.just(TOPIC), legal_unknown_topic),
    )
    def run(url: str, case: tuple[bytes, int, str | None], topic: str) -> None:
        body, status, field = case
        reply = call(url, "POST", f"/v1/topics/{quote(topic)}/messages", body)
        assert_api_error(reply, (status,), field)

    run()
    fuzz_cluster.assert_untouched()


@pytest.mark.parametrize("defect", MESSAGE_DEFECTS)
def test_produce_rejects_a_batch_with_one_bad_message(
    fuzz_cluster: FuzzCluster, defect: str
) -> None:
    @settings(FUZZ, max_examples=20)
    @given(
        url=st.sampled_from(fuzz_cluster.urls),
        case=batch_with_one_bad_message(defect),
        topic=st.one_of(st.just(TOPIC), legal_unknown_topic),
    )
    def run(url: str, case: tuple[bytes, int, str | None], topic: str) -> None:
        body, status, field = case
        reply = call(url, "POST", f"/v1/topics/{quote(topic)}/messages", body)
        assert_api_error(reply, (status,), field)

    run()
    fuzz_cluster.assert_untouched()


def test_produce_to_illegal_topic_is_refused(fuzz_cluster: FuzzCluster) -> None:
    @FUZZ
    @given(
        url=st.sampled_from(fuzz_cluster.urls),
        topic=illegal_topic,
        messages=st.lists(valid_message, min_size=1, max_size=3),
    )
    def run(url: str, topic: str, messages: list[dict[str, Any]]) -> None:
        body = dumps({"messages": messages})
        reply = call(url, "POST", f"/v1/topics/{quote(topic)}/messages", body)
        assert_api_error(reply)

    run()
    fuzz_cluster.assert_untouched()


def test_bad_idempotency_key_is_refused(fuzz_cluster: FuzzCluster) -> None:
    @FUZZ
    @given(
        url=st.sampled_from(fuzz_cluster.urls),
        key=st.one_of(
            st.just(""),
            st.text(string.ascii_letters + string.digits, min_size=201, max_size=400),
        ),
    )
    def run(url: str, key: str) -> None:
        body = dumps({"messages": [{"body": "never stored"}]})
        reply = call(
            url,
            "POST",
            f"/v1/topics/{TOPIC}/messages",
            body,
            headers={"Idempotency-Key": key},
        )
        assert_api_error(reply, (400,), "Idempotency-Key")

    run()
    fuzz_cluster.assert_untouched()


def test_request_over_max_request_bytes_is_413_everywhere(fuzz_cluster: FuzzCluster) -> None:
    filler = "x" * (MAX_REQUEST_BYTES + 1024)
    bodies = {
        ("POST", f"/v1/topics/{TOPIC}/messages"): {"messages": [{"body": filler}]},
        ("PUT", f"/v1/topics/{TOPIC}"): {"queues": QUEUES, "pad": filler},
        ("PUT", "/v1/groups/fuzz-group/offsets"): {"topic": TOPIC, "pad": filler},
        ("PATCH", "/v1/admin/config"): {"log_level": filler},
        ("POST", "/v1/admin/leadership/transfer"): {"to": filler},
    }
    for url in fuzz_cluster.urls:
        for (method, path), body in bodies.items():
            reply = call(url, method, path, dumps(body))
            data = assert_api_error(reply, (413,))
            assert data["error"] == "request_too_large", (url, method, path, data)
    fuzz_cluster.assert_untouched()


def test_oversized_message_and_batch_are_413(fuzz_cluster: FuzzCluster) -> None:
    for url in fuzz_cluster.urls:
        big = dumps({"messages": [{"body": "y" * (MAX_MESSAGE_BYTES + 1)}]})
        data = assert_api_error(
            call(url, "POST", f"/v1/topics/{TOPIC}/messages", big), (413,), "messages[0].body"
        )
        assert data["error"] == "message_too_large"
        many = dumps({"messages": [{"body": "z"}] * (MAX_MESSAGES_PER_REQUEST + 1)})
        data = assert_api_error(
            call(url, "POST", f"/v1/topics/{TOPIC}/messages", many), (413,), "messages"
        )
        assert data["error"] == "too_many_messages"
    fuzz_cluster.assert_untouched()


# ---------------------------------------------------------------------- pull and describe


def _int_text_failing(s: str) -> bool:
    try:
        int(s)
    except ValueError:
        return True
    return False


not_an_int_text = st.one_of(
    st.text(max_size=12).filter(_int_text_failing),
    st.sampled_from(["", "1.5", "1e3", "0x10", "--1", "one", "NaN", "inf"]),
    st.integers(4301, 6000).map(lambda n: "9" * n),
)


def param(lo: int, hi: int, valid_hi: int | None = None) -> st.SearchStrategy[tuple[str, bool]]:
    """(value, is_valid) for a query parameter accepted in [lo, hi]."""
    top = hi if valid_hi is None else valid_hi
    return st.one_of(
        st.integers(lo, top).map(lambda v: (str(v), True)),
        st.integers(max_value=lo - 1, min_value=-(2**80)).map(lambda v: (str(v), False)),
        st.integers(hi + 1, 2**80).map(lambda v: (str(v), False)),
        not_an_int_text.map(lambda v: (v, False)),
    )


# (path segment, kind): "ok" names an existing queue, "absent" a well-formed queue id the topic
# does not have (404), "bad" anything that is not a queue id (400).
queue_segment = st.one_of(
    st.integers(0, QUEUES - 1).map(lambda q: (str(q), "ok")),
    st.integers(QUEUES, 10**18 - 1).map(lambda q: (str(q), "absent")),
    st.integers(10**18, 10**30).map(lambda q: (str(q), "bad")),
    st.integers(4301, 6000).map(lambda n: ("9" * n, "bad")),
    st.sampled_from(["-1", "+1", " 1", "1.0", "0x1", "²", "١", "٣", "𝟘", "1_0"]).map(
        lambda q: (q, "bad")
    ),
    st.text(min_size=1, max_size=12)
    .filter(lambda s: not (s.isascii() and s.isdigit()) and s not in (".", ".."))
    .map(lambda q: (q, "bad")),
)


def test_pull_rejects_bad_queues_offsets_and_topics(fuzz_cluster: FuzzCluster) -> None:
    @settings(FUZZ, max_examples=300)
    @given(
        url=st.sampled_from(fuzz_cluster.urls),
        topic=st.one_of(st.just(TOPIC), legal_unknown_topic, illegal_topic),
        queue=queue_segment,
        params=st.fixed_dictionaries(
            {},
            optional={
                "offset": param(0, 2**62),
                "max": param(1, MAX_PULL_MESSAGES),
                "wait_ms": param(0, MAX_WAIT_MS, valid_hi=2_000),
            },
        ),
    )
    def run(
        url: str, topic: str, queue: tuple[str, str], params: dict[str, tuple[str, bool]]
    ) -> None:
        queue_text, queue_kind = queue
        params_ok = all(ok for _, ok in params.values())
        assume(not (topic == TOPIC and queue_kind == "ok" and params_ok))
        query = urllib.parse.urlencode(
            {k: v for k, (v, _) in params.items()}, quote_via=urllib.parse.quote
        )
        path = f"/v1/topics/{quote(topic)}/queues/{quote(queue_text)}/messages"
        target = f"{path}?{query}" if query else path
        assume(len(target) < 8000)  # longer request lines are refused by the HTTP parser
        status = 400 if queue_kind == "bad" or not params_ok else 404
        off_route = leaves_route(topic) or leaves_route(queue_text)
        statuses = (status, 404) if off_route else (status,)
        assert_api_error(call(url, "GET", target), statuses)

    run()
    fuzz_cluster.assert_untouched()


def test_describe_unknown_or_illegal_topic(fuzz_cluster: FuzzCluster) -> None:
    @FUZZ
    @given(
        url=st.sampled_from(fuzz_cluster.urls), topic=st.one_of(legal_unknown_topic, illegal_topic)
    )
    def run(url: str, topic: str) -> None:
        assert_api_error(call(url, "GET", f"/v1/topics/{quote(topic)}"), (400, 404))

    run()
    fuzz_cluster.assert_untouched()


# ---------------------------------------------------------------------- groups and topics


OFFSET_DEFECTS = (
    "raw",
    "not_object",
    "topic_type",
    "topic_missing",
    "topic_unknown",
    "queue_type",
    "queue_negative",
    "queue_unknown",
    "offset_type",
    "offset_negative",
    "group",
)


@st.composite
def bad_offset_commit(draw: st.DrawFn, kind: str) -> tuple[str, bytes, tuple[int, ...]]:
    """(group, body, statuses) for PUT /v1/groups/{group}/offsets with the defect ``kind``."""
    group = "fuzz-group"
    body: dict[str, Any] = {
        "topic": TOPIC,
        "queue": draw(st.integers(0, QUEUES - 1)),
        "offset": draw(st.integers(0, 2**62)),
    }
    statuses: tuple[int, ...] = (400,)
    if kind == "raw":
        return group, draw(st.binary(max_size=100).filter(lambda b: b[:1] != b"{")), statuses
    if kind == "not_object":
        return group, dumps(draw(json_values.filter(lambda v: not isinstance(v, dict)))), statuses
    if kind == "topic_type":
        body["topic"] = draw(not_str)
    elif kind == "topic_missing":
        del body["topic"]
    elif kind == "topic_unknown":
        body["topic"] = draw(st.one_of(legal_unknown_topic, illegal_topic))
        statuses = (400, 404)
    elif kind == "queue_type":
        body["queue"] = draw(not_int)
    elif kind == "queue_negative":
        body["queue"] = draw(st.integers(max_value=-1, min_value=-(2**70)))
    elif kind == "queue_unknown":
        body["queue"] = draw(st.integers(QUEUES, 2**63))
        statuses = (404,)
    elif kind == "offset_type":
        body["offset"] = draw(not_int)
    elif kind == "offset_negative":
        body["offset"] = draw(st.integers(max_value=-1, min_value=-(2**70)))
    elif kind == "group":
        group = draw(illegal_topic)
        statuses = (400, 404)  # "." and ".." are dot segments: the path leaves the route
    return group, dumps(body), statuses


@pytest.mark.parametrize("defect", OFFSET_DEFECTS)
def test_group_offset_commit_rejects_bad_bodies(fuzz_cluster: FuzzCluster, defect: str) -> None:
    @settings(FUZZ, max_examples=25)
    @given(url=st.sampled_from(fuzz_cluster.urls), case=bad_offset_commit(defect))
    def run(url: str, case: tuple[str, bytes, tuple[int, ...]]) -> None:
        group, body, statuses = case
        reply = call(url, "PUT", f"/v1/groups/{quote(group)}/offsets", body)
        assert_api_error(reply, statuses)

    run()
    for url in fuzz_cluster.urls:
        offsets = call(url, "GET", "/v1/groups/fuzz-group/offsets").json()
        assert offsets["offsets"] == []
    fuzz_cluster.assert_untouched()


@st.composite
def bad_topic_create(draw: st.DrawFn, kind: str) -> tuple[str, bytes, tuple[int, ...]]:
    """(topic, body, statuses) for PUT /v1/topics/{topic} that must create nothing."""
    if kind == "existing":
        queues = draw(st.integers(-(2**63), 2**63).filter(lambda q: q != QUEUES))
        return TOPIC, dumps({"queues": queues}), (409,)
    topic = draw(legal_unknown_topic)
    if kind == "new_range":
        queues = draw(
            st.one_of(st.integers(-(2**70), 0), st.integers(1025, 2**70)),
        )
        return topic, dumps({"queues": queues}), (400,)
    if kind == "new_type":
        body = draw(
            st.one_of(
                json_values.filter(lambda v: not isinstance(v, dict)),
                not_int.map(lambda q: {"queues": q}),
            )
        )
        return topic, dumps(body), (400,)
    if kind == "raw":
        return topic, draw(st.binary(max_size=100).filter(lambda b: b[:1] != b"{")), (400,)
    body = draw(st.one_of(st.just({"queues": QUEUES}), st.just({})))
    return draw(illegal_topic), dumps(body), (400, 404)


@pytest.mark.parametrize("kind", ["existing", "new_range", "new_type", "raw", "illegal"])
def test_topic_create_rejects_bad_queues(fuzz_cluster: FuzzCluster, kind: str) -> None:
    @settings(FUZZ, max_examples=30)
    @given(url=st.sampled_from(fuzz_cluster.urls), case=bad_topic_create(kind))
    def run(url: str, case: tuple[str, bytes, tuple[int, ...]]) -> None:
        topic, body, statuses = case
        assert_api_error(call(url, "PUT", f"/v1/topics/{quote(topic)}", body), statuses)

    run()
    for url in fuzz_cluster.urls:
        topics = [t["topic"] for t in call(url, "GET", "/v1/topics").json()["topics"]]
        assert topics == [TOPIC]
    fuzz_cluster.assert_untouched()


# ---------------------------------------------------------------------- admin


def _bad_runtime_value(key: Key) -> st.SearchStrategy[Any]:
    if key.type is bool:
        return json_values.filter(lambda v: not isinstance(v, bool))
    if key.type is float:
        lo, hi = key.min, key.max
        assert lo is not None and hi is not None
        return st.one_of(
            json_values.filter(lambda v: isinstance(v, bool) or not isinstance(v, int | float)),
            st.floats(max_value=lo, allow_infinity=False, allow_nan=False).filter(lambda x: x < lo),
            st.floats(min_value=hi, allow_infinity=False, allow_nan=False).filter(lambda x: x > hi),
            st.integers(max_value=math.ceil(lo) - 1, min_value=-(2**60)),
            st.integers(min_value=math.floor(hi) + 1, max_value=2**60),
        )
    if key.type is str and key.choices:
        choices = key.choices
        return json_values.filter(lambda v: v not in choices)
    raise AssertionError(f"no bad-value strategy for runtime key {key.name}")


def _good_runtime_value(key: Key) -> st.SearchStrategy[Any]:
    if key.type is bool:
        return st.booleans()
    if key.type is float:
        return st.floats(key.min, key.max)
    assert key.choices
    return st.sampled_from(key.choices)


@st.composite
def config_entry(draw: st.DrawFn) -> tuple[str, Any, int | None]:
    """(name, value, status it earns or None when the value would be accepted)."""
    kind = draw(st.sampled_from(["unknown", "static", "runtime_bad", "runtime_good"]))
    if kind == "unknown":
        return (
            draw(st.text(max_size=30).filter(lambda s: s not in KEY_BY_NAME and s not in RENAMED)),
            draw(json_values),
            400,
        )
    if kind == "static":
        key = draw(st.sampled_from(STATIC_KEYS))
        return key.name, draw(st.one_of(json_values, st.just(key.default))), 409
    key = draw(st.sampled_from(RUNTIME_KEYS))
    if kind == "runtime_bad":
        return key.name, draw(_bad_runtime_value(key)), 400
    return key.name, draw(_good_runtime_value(key)), None


@st.composite
def bad_config_patch(draw: st.DrawFn) -> tuple[bytes, int, str]:
    """A PATCH body with at least one refused entry; (body, status, field the error names)."""
    if draw(st.integers(0, 5)) == 0:
        raw = draw(
            st.one_of(
                st.binary(max_size=60).filter(lambda b: b[:1] != b"{"),
                json_values.filter(lambda v: not isinstance(v, dict)).map(dumps),
                st.just(b"{}"),
            )
        )
        return raw, 400, "body"
    entries = draw(st.lists(config_entry(), min_size=1, max_size=5, unique_by=lambda e: e[0]))
    assume(any(status is not None for _, _, status in entries))
    # The first unknown or static key is refused before any value is looked at.
    for name, _, status in entries:
        if status in (400, 409) and (name not in KEY_BY_NAME or not KEY_BY_NAME[name].runtime):
            expected = (status, name)
            break
    else:
        expected = next((s, n) for n, _, s in entries if s is not None)
    body = dumps({name: value for name, value, _ in entries})
    return body, expected[0], expected[1]


def test_config_patch_rejects_unknown_static_and_bad_values(fuzz_cluster: FuzzCluster) -> None:
    @settings(FUZZ, max_examples=200)
    @given(url=st.sampled_from(fuzz_cluster.urls), case=bad_config_patch())
    def run(url: str, case: tuple[bytes, int, str]) -> None:
        body, status, field = case
        data = assert_api_error(call(url, "PATCH", "/v1/admin/config", body), (status,))
        assert data["field"] == field, data

    run()
    fuzz_cluster.assert_untouched()


def test_leadership_transfer_to_unknown_peer_is_refused(fuzz_cluster: FuzzCluster) -> None:
    leader_before = fuzz_cluster.cluster.leader()

    @FUZZ
    @given(
        url=st.sampled_from(fuzz_cluster.urls),
        target=st.one_of(
            json_values.filter(lambda v: v is not None and not (type(v) is int and v in PEER_IDS)),
            st.sampled_from([True, False, 0.0, 1.0, 2.0, "1", [1]]),
        ),
    )
    def run(url: str, target: Any) -> None:
        body = dumps({"to": target})
        reply = call(url, "POST", "/v1/admin/leadership/transfer", body)
        assert_api_error(reply, (400,), "to")

    run()
    assert_api_error(call(fuzz_cluster.urls[0], "POST", "/v1/admin/leadership/transfer", b"{"))
    assert fuzz_cluster.cluster.leader() == leader_before
    fuzz_cluster.assert_untouched()


# ---------------------------------------------------------------------- bad configuration


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_string(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(type(v))


def toml_string(s: str) -> str:
    """A TOML basic string: escapes for the quote, the backslash and control characters."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


toml_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=12)
toml_scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    toml_text,
)
toml_values = st.one_of(
    toml_scalars,
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(
        st.text(string.ascii_letters, min_size=1, max_size=4), st.integers(), max_size=2
    ),
)
BAD_DELAY_LEVELS = ["", "   ", "1s 5", "5x", "1.5s", "-1s", "s", "1s, 2s", "１s", "10 s"]


def bad_config_value(key: Key) -> st.SearchStrategy[Any]:
    """Values of ``key`` that a node must refuse at start."""
    if key.type is int:
        wrong: st.SearchStrategy[Any] = toml_values.filter(
            lambda v: isinstance(v, bool) or not isinstance(v, int)
        )
    elif key.type is float:
        wrong = toml_values.filter(lambda v: isinstance(v, bool) or not isinstance(v, int | float))
    else:
        t = key.type
        wrong = toml_values.filter(lambda v: not isinstance(v, t))
    options = [wrong]
    if key.type in (int, float) and key.min is not None:
        lo = key.min
        options.append(st.integers(-(2**63), math.ceil(lo) - 1))
        if key.type is float:
            options.append(st.floats(max_value=lo, allow_nan=False).filter(lambda x: x < lo))
    if key.type in (int, float) and key.max is not None:
        hi = key.max
        options.append(st.integers(math.floor(hi) + 1, 2**63 - 1))
        if key.type is float:
            options.append(st.floats(min_value=hi, allow_nan=False).filter(lambda x: x > hi))
    if key.choices:
        choices = key.choices
        options.append(toml_text.filter(lambda s: s not in choices))
    if key.name == "message_delay_level":
        options.append(st.sampled_from(BAD_DELAY_LEVELS))
    if key.name == "peers":
        options.append(
            st.sampled_from([[1], [{"id": 1}], [{"id": 1, "raft": "nohost", "http": "http://h"}]])
        )
    return st.one_of(*options)


def test_config_file_with_a_bad_value_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"

    @FUZZ
    @given(case=st.sampled_from(KEYS).flatmap(lambda k: st.tuples(st.just(k), bad_config_value(k))))
    def run(case: tuple[Key, Any]) -> None:
        key, value = case
        path.write_text(f"{key.name} = {toml_value(value)}\n", encoding="utf-8")
        with pytest.raises(ConfigError) as info:
            load(path, environ={})
        assert info.value.key == key.name
        assert key.name in str(info.value)

    run()


def test_config_file_with_an_unknown_key_names_it(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"

    @FUZZ
    @given(
        name=st.from_regex(r"[a-z][a-z0-9_]{0,30}", fullmatch=True).filter(
            lambda s: s not in KEY_BY_NAME and s not in RENAMED  # an old name is still read
        ),
        value=toml_scalars,
    )
    def run(name: str, value: Any) -> None:
        path.write_text(f"{name} = {toml_value(value)}\n", encoding="utf-8")
        with pytest.raises(ConfigError) as info:
            load(path, environ={})
        assert info.value.key == name

    run()


ENV_BOOL_WORDS = frozenset({"1", "true", "yes", "on", "0", "false", "no", "off"})


def _not_read_as(key: Key) -> st.SearchStrategy[str]:
    """Environment strings that cannot be read as ``key``'s type."""

    def refused(s: str) -> bool:
        if key.type is bool:
            return s.strip().lower() not in ENV_BOOL_WORDS
        try:
            key.type(s)
        except ValueError:
            return True
        return False

    return st.text(
        alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
        max_size=12,
    ).filter(refused)


def test_environment_override_with_a_bad_value_names_the_key() -> None:
    typed = [k for k in KEYS if k.type in (int, float, bool)]

    @FUZZ
    @given(case=st.sampled_from(typed).flatmap(lambda k: st.tuples(st.just(k), _not_read_as(k))))
    def run(case: tuple[Key, str]) -> None:
        key, raw = case
        with pytest.raises(ConfigError) as info:
            load(None, environ={f"CHRONOMQ_{key.name.upper()}": raw})
        assert info.value.key == key.name

    run()


@pytest.mark.parametrize("value", ["nan", "NaN", "-nan"])
def test_nan_sample_rate_is_refused(tmp_path: Path, value: str) -> None:
    """NaN compares false with both bounds, so a plain range check lets it through."""
    path = tmp_path / "node.toml"
    path.write_text(f"ops_log_sample_rate = {value.lower()}\n")
    with pytest.raises(ConfigError) as info:
        load(path, environ={})
    assert info.value.key == "ops_log_sample_rate"
    with pytest.raises(ConfigError):
        load(None, environ={"CHRONOMQ_OPS_LOG_SAMPLE_RATE": value})


NODE_START_CASES = {
    "unknown key": ("bogus_key = 1\n", {}, "bogus_key"),
    "wrong type": ('max_wait_ms = "soon"\n', {}, "max_wait_ms"),
    "bool for an int": ("max_pull_messages = true\n", {}, "max_pull_messages"),
    "below the minimum": ("max_message_bytes = 0\n", {}, "max_message_bytes"),
    "above the maximum": ("wire_compression_level = 10\n", {}, "wire_compression_level"),
    "not a choice": ('flush = "sometimes"\n', {}, "flush"),
    "bad delay level": ('message_delay_level = "1s 5x 10s"\n', {}, "message_delay_level"),
    "empty delay levels": ('message_delay_level = ""\n', {}, "message_delay_level"),
    "election timeouts crossed": (
        "raft_min_timeout_ms = 600\nraft_max_timeout_ms = 600\n",
        {},
        "raft_max_timeout_ms",
    ),
    "election timeout below heartbeats": (
        "raft_min_timeout_ms = 100\nraft_max_timeout_ms = 600\nappend_entries_period_ms = 50\n",
        {},
        "raft_min_timeout_ms",
    ),
    "bad peer": ('[[peers]]\nid = 1\nraft = "nohost"\nhttp = "http://127.0.0.1:1"\n', {}, "peers"),
    "not TOML": ("max_wait_ms = \n", {}, "config"),
    "bad environment override": ("", {"CHRONOMQ_MAX_WAIT_MS": "soon"}, "max_wait_ms"),
}


@pytest.mark.parametrize("case", list(NODE_START_CASES), ids=list(NODE_START_CASES))
def test_node_with_bad_config_exits_naming_the_key(tmp_path: Path, case: str) -> None:
    extra, env, key = NODE_START_CASES[case]
    http_port, raft_port = free_port_base(1, random.Random())
    data_dir = tmp_path / "data"
    config = tmp_path / "node.toml"
    base = (
        f"data_dir = {toml_string(str(data_dir))}\nhttp_port = {http_port}\n"
        f"raft_port = {raft_port}\nfetch_port = {raft_port + 1000}\n"
    )
    config.write_text(base + extra)  # after the plain keys, so a [[peers]] table stays last
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("CHRONOMQ_")}
    # A node that wrongly accepts the config serves until killed: the timeout fails the test.
    proc = subprocess.run(
        [sys.executable, "-m", "chronomq.cluster", "node", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**child_env, **env},
        cwd=tmp_path,
    )
    assert proc.returncode != 0, proc.stderr
    assert key in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not data_dir.exists(), "a refused config must not touch the data directory"
