"""Ports are planned before anything starts: a node's own listeners never share a port, and a
local cluster's derived ports move on rather than clash (``cluster/process/ports.py``)."""

from __future__ import annotations

import pytest

from chronomq.cluster.config.nodeconfig import ConfigError, load
from chronomq.cluster.process.ports import PortBlock, plan_ports


def test_grpc_derived_onto_the_raft_ports_moves_on() -> None:
    """The issue's ``--http-port 23500 --raft-port 23600``: gRPC's default (HTTP + 100) is
    the Raft block; it moves on by 100."""
    plan = plan_ports(3, 23500, 23600)
    assert plan.grpc == PortBlock("grpc_port", 23700, 3, "http_port + 100 + 100")
    assert plan.fetch == PortBlock("fetch_port", 24600, 3, "raft_port + 1000")
    blocks = [plan.http, plan.grpc, plan.raft, plan.fetch]
    ports = [b.base + i for b in blocks for i in range(3)]
    assert len(set(ports)) == len(ports)


def test_catch_up_derived_onto_the_http_ports_moves_on() -> None:
    plan = plan_ports(3, 10080, 9080)
    assert plan.fetch.base == 11080 and plan.grpc.base == 10180


def test_the_defaults_stay_where_they_were() -> None:
    plan = plan_ports(3, 8080, 9080)
    assert (plan.http.base, plan.grpc.base, plan.raft.base, plan.fetch.base) == (
        8080,
        8180,
        9080,
        10080,
    )
    assert plan.grpc.derived_from == "http_port + 100"


@pytest.mark.parametrize(
    ("nodes", "http", "raft", "grpc", "fetch", "named", "also"),
    [
        (3, 23500, 23600, 23600, None, "grpc_port", "raft_port"),
        (3, 23500, 23502, None, None, "raft_port", "http_port"),
        (5, 8080, 9080, 8082, None, "grpc_port", "http_port"),
        (3, 8080, 9080, None, 9081, "fetch_port", "raft_port"),
    ],
)
def test_given_ports_that_clash_are_refused_naming_both(
    nodes: int, http: int, raft: int, grpc: int | None, fetch: int | None, named: str, also: str
) -> None:
    with pytest.raises(ConfigError) as err:
        plan_ports(nodes, http, raft, grpc, fetch)
    assert err.value.key == named
    assert f"{named} (" in err.value.problem and f"overlaps {also} (" in err.value.problem


def test_a_block_past_the_last_port_is_refused() -> None:
    with pytest.raises(ConfigError, match="http_port .* not within 1-65535"):
        plan_ports(3, 65534, 9080)


@pytest.mark.parametrize(
    ("overrides", "named", "also"),
    [
        (
            {"http_port": "9000", "raft_port": "9100"},
            "grpc_port (http_port + 100 = 9100)",
            "raft_port (9100)",
        ),
        ({"raft_port": "9080", "fetch_port": "8080"}, "http_port (8080)", "fetch_port (8080)"),
        ({"grpc_port": "9080"}, "grpc_port (9080)", "raft_port (9080)"),
        (
            {"http_port": "9081", "raft_port": "8081"},
            "fetch_port (raft_port + 1000 = 9081)",
            "http_port (9081)",
        ),
    ],
)
def test_a_node_whose_listeners_share_a_port_is_refused_naming_both(
    overrides: dict[str, str], named: str, also: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load(None, environ={}, overrides=overrides)
    assert err.value.problem.startswith(f"{named} is also {also}"), err.value.problem


def test_one_port_on_two_addresses_is_no_clash() -> None:
    cfg = load(
        None,
        environ={},
        overrides={"grpc_host": "127.0.0.2", "grpc_port": "9080", "raft_host": "127.0.0.1"},
    )
    assert cfg.grpc_listen_port == cfg.raft_port == 9080
    with pytest.raises(ConfigError, match="grpc_port"):
        load(
            None,
            environ={},
            overrides={"grpc_host": "0.0.0.0", "grpc_port": "9080", "allow_insecure": "true"},
        )
