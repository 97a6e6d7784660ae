"""A schema-driven fuzz of a real 3-node cluster from its own ``/openapi.json`` (schemathesis).

For every operation the spec describes, schemathesis generates requests that fit the schema
(positive) and requests that break it (negative), sends them to the leader and to a follower
(which forwards writes), and checks that:

- no answer is a 5xx;
- every answer, 2xx or 4xx, conforms to the schema the spec gives for its status;
- no request that the schema forbids is accepted (answered 2xx).

It runs twice: without ``auth_token`` and with one (every request then carries the bearer
token, and the spec describes the 401 of every route but the open ones).

Bounded: ``CHRONOMQ_FUZZ_EXAMPLES`` examples per operation and mode (default 25) and
``CHRONOMQ_FUZZ_BUDGET_S`` seconds in all per run (default 240). The seed is printed on failure.
Left out: routes whose positive requests change the cluster's shape (members, leadership,
the signed removal notice) are fuzzed with negative requests only; ``/metrics``, the console's
static files and the internal binary TimerLog route are not JSON and are left out.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    negative_data_rejection,
    response_schema_conformance,
)

from chronomq.cluster.process.launcher import LocalCluster  # noqa: E402
from tests.integration.conftest import dump_logs, free_port_base  # noqa: E402

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("CHRONOMQ_FUZZ_EXAMPLES", "25"))
BUDGET_S = float(os.environ.get("CHRONOMQ_FUZZ_BUDGET_S", "240"))
NOT_JSON = {
    ("GET", "/metrics"),
    ("GET", "/v1/admin/timer/log"),
    ("GET", "/console"),
    ("GET", "/console/{file}"),
}
NEGATIVE_ONLY = {
    ("POST", "/v1/admin/members"),
    ("DELETE", "/v1/admin/members/{id}"),
    ("POST", "/v1/admin/leadership/transfer"),
    ("POST", "/v1/admin/node/removal"),
}
CHECKS = [not_a_server_error, response_schema_conformance, negative_data_rejection]
TOKEN = "fuzz-token-0123456789abcdef"


def _cluster(tmp_path: Path, token: str | None) -> LocalCluster:
    http, raft = free_port_base(3, random.Random())
    # Long polls bounded so that a generated wait_ms costs little.
    settings = {"max_wait_ms": "200", "commit_timeout_ms": "5000"}
    if token is not None:
        settings["auth_token"] = token
    cluster = LocalCluster(
        3,
        tmp_path / "fuzz",
        http_port=http,
        raft_port=raft,
        settings=settings,
    )
    cluster.start()
    return cluster


def _runner(
    op: Any,
    mode: GenerationMode,
    base_urls: list[str],
    run_seed: int,
    found: dict[tuple[str, str, str], str],
    headers: dict[str, str],
) -> Any:
    key = (op.method.upper(), op.path, mode.value)

    @seed(run_seed)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        for url in base_urls:
            try:
                case.call_and_validate(base_url=url, checks=CHECKS, headers=headers, timeout=15)
            except (AssertionError, BaseExceptionGroup) as exc:  # schemathesis' failures
                found.setdefault(key, f"{key} at {url}: {exc}")

    return run


def _failures(
    schema: Any, base_urls: list[str], run_seed: int, headers: dict[str, str]
) -> list[str]:
    found: dict[tuple[str, str, str], str] = {}
    deadline = time.monotonic() + BUDGET_S
    for result in schema.get_all_operations():
        op = result.ok()
        key = (op.method.upper(), op.path)
        if key in NOT_JSON:
            continue
        modes = [GenerationMode.NEGATIVE]
        if key not in NEGATIVE_ONLY:
            modes.insert(0, GenerationMode.POSITIVE)
        for mode in modes:
            if time.monotonic() > deadline:
                return [*found.values(), f"time budget of {BUDGET_S} s spent before {key}"]

            run = _runner(op, mode, base_urls, run_seed, found, headers)
            try:
                run()
            except (Exception, BaseExceptionGroup) as exc:
                if type(exc).__name__ != "Unsatisfiable":  # nothing to break, e.g. no input
                    found.setdefault((*key, mode.value), f"{key} {mode.value}: {exc!r}")
    return list(found.values())


def _token_sent_apart(doc: dict[str, Any]) -> dict[str, Any]:
    """The spec without its security requirements: every request carries the token (added at
    call time), so schemathesis must not make "negative" cases by leaving it out (the token
    added back would turn them into valid requests, a member's removal among them)."""
    doc = {**doc, "security": []}
    doc["components"] = {k: v for k, v in doc["components"].items() if k != "securitySchemes"}
    doc["paths"] = {
        path: {
            method: {k: v for k, v in op.items() if k != "security"} for method, op in ops.items()
        }
        for path, ops in doc["paths"].items()
    }
    return doc


@pytest.mark.parametrize("token", [None, TOKEN], ids=["open", "auth_token"])
def test_the_api_keeps_to_its_own_openapi(tmp_path: Path, token: str | None) -> None:
    cluster = _cluster(tmp_path, token)
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        leader = cluster.wait_leader(30)
        cluster.wait_all_know_leader(30)
        follower = next(i for i in range(cluster.n) if i != leader)
        urls = [cluster.http_url(leader), cluster.http_url(follower)]
        # Something to read: a topic with messages, plain and delayed.
        r = requests.post(
            f"{urls[0]}/v1/topics/fuzz/messages",
            json={"messages": [{"body": "a", "tags": "t"}, {"body": "b", "delay_level": 1}]},
            headers=headers,
            timeout=10,
        )
        assert r.status_code == 200, r.text
        doc = requests.get(f"{urls[0]}/openapi.json", headers=headers, timeout=10).json()
        assert bool(doc["security"]) == (token is not None)
        schema = schemathesis.openapi.from_dict(_token_sent_apart(doc))
        run_seed = int(os.environ.get("CHRONOMQ_FUZZ_SEED", random.randrange(2**32)))
        failures = _failures(schema, urls, run_seed, headers)
        for i in range(cluster.n):
            assert cluster.alive(i), f"node {i} died\n{dump_logs(cluster)}"
        assert not failures, f"seed {run_seed} (CHRONOMQ_FUZZ_SEED):\n\n" + "\n\n".join(
            f[:3000] for f in failures
        )
    finally:
        cluster.stop()
