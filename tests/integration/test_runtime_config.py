"""Runtime config on a real 3-node cluster: a PATCH on any node is the cluster's, every node
applies it (the log level for real), the schedule mode and the timer switches are the same state
whichever route changes them, and a restarted node comes back with the cluster's values."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from chronomq.cluster.process.launcher import LocalCluster
from tests.integration.conftest import wait_for

CHANGED = "config changed cluster-wide: "


class Nodes:
    def __init__(self, cluster: LocalCluster, session: aiohttp.ClientSession) -> None:
        self.cluster = cluster
        self.s = session

    async def call(
        self, i: int, method: str, path: str, body: Any = None
    ) -> tuple[int, dict[str, Any]]:
        async with self.s.request(method, self.cluster.http_url(i) + path, json=body) as r:
            return r.status, await r.json()

    async def patch(self, i: int, body: dict[str, Any]) -> dict[str, Any]:
        status, answer = await self.call(i, "PATCH", "/v1/admin/config", body)
        assert status == 200, answer
        return answer

    async def configs(self) -> list[dict[str, Any]]:
        return [(await self.call(i, "GET", "/v1/admin/config"))[1] for i in range(3)]

    async def agree(self, runtime: dict[str, Any], what: str) -> list[dict[str, Any]]:
        """Wait until every node shows ``runtime`` among its overrides and in its config."""

        async def check() -> list[dict[str, Any]] | None:
            views = await self.configs()
            for v in views:
                if any(v["runtime"].get(k) != val for k, val in runtime.items()):
                    return None
                if any(v["config"][k] != val for k, val in runtime.items()):
                    return None
            return views

        views: list[dict[str, Any]] = await wait_for(check, 20, what, self.cluster)
        return views


def _log(cluster: LocalCluster, i: int) -> Path:
    return cluster.node_dir(i) / "node.log"


def _lines_after(cluster: LocalCluster, i: int, offset: int) -> str:
    with open(_log(cluster, i), "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _ends(cluster: LocalCluster) -> list[int]:
    return [_log(cluster, i).stat().st_size for i in range(3)]


def test_runtime_config_is_cluster_wide_and_real(make_cluster: Any) -> None:
    cluster: LocalCluster = make_cluster(3)
    leader = cluster.wait_leader(60)
    follower = next(i for i in range(3) if i != leader)
    other = next(i for i in range(3) if i not in (leader, follower))

    async def go() -> None:
        async with aiohttp.ClientSession() as s:
            n = Nodes(cluster, s)
            before = await n.configs()
            assert all(v["runtime"] == {} for v in before), before
            assert before[0]["runtime_keys"] == [
                "log_level",
                "ops_log_enabled",
                "ops_log_sample_rate",
                "enable_schedule_async_deliver",
                "timer_stop_enqueue",
                "timer_stop_dequeue",
            ]

            # Bad inputs: refused before anything is forwarded, naming the key.
            for body, status, code, field in (
                ({"no_such_key": 1}, 400, "unknown_key", "no_such_key"),
                ({"log_level": "error", "flush": "sync"}, 409, "not_runtime", "flush"),
                ({"log_level": "loud"}, 400, "invalid_config", "log_level"),
                ({"ops_log_sample_rate": 1.5}, 400, "invalid_config", "ops_log_sample_rate"),
                ({"timer_stop_dequeue": "yes"}, 400, "invalid_config", "timer_stop_dequeue"),
                ([1], 400, "invalid_input", "body"),
            ):
                for i in (leader, follower):
                    got, err = await n.call(i, "PATCH", "/v1/admin/config", body)
                    assert (got, err["error"], err["field"]) == (status, code, field), (body, err)
            assert [v["runtime"] for v in await n.configs()] == [{}, {}, {}]

            # A PATCH on a follower is committed by the leader and applied on every node; the
            # answer comes once the follower has applied it.
            ends = _ends(cluster)
            answer = await n.patch(follower, {"log_level": "error", "ops_log_sample_rate": 0.5})
            assert answer["runtime"] == {"log_level": "error", "ops_log_sample_rate": 0.5}
            assert answer["config"]["log_level"] == "error"
            assert answer["changed"] == ["log_level", "ops_log_sample_rate"]
            views = await n.agree({"log_level": "error", "ops_log_sample_rate": 0.5}, "PATCH 1")
            assert views[0]["runtime"] == views[1]["runtime"] == views[2]["runtime"]
            for i in range(3):
                text = _lines_after(cluster, i, ends[i])
                assert f"{CHANGED}log_level info → error" in text, (i, text)

            # At error, an INFO line is no longer written, on any node.
            ends = _ends(cluster)
            await n.patch(leader, {"ops_log_enabled": False})
            await n.agree({"ops_log_enabled": False}, "ops logs off")
            for i in range(3):
                assert CHANGED not in _lines_after(cluster, i, ends[i]), i
            # Back at info, it is.
            await n.patch(other, {"log_level": "info"})
            await n.agree({"log_level": "info"}, "log level info")
            ends = _ends(cluster)
            await n.patch(follower, {"ops_log_enabled": True})
            await n.agree({"ops_log_enabled": True}, "ops logs on")
            for i in range(3):
                text = _lines_after(cluster, i, ends[i])
                assert f"{CHANGED}ops_log_enabled false → true" in text, (i, text)

            # enable_schedule_async_deliver is the schedule's mode, both ways.
            await n.patch(follower, {"enable_schedule_async_deliver": True})

            async def mode_is(mode: str) -> bool:
                views = [await n.call(i, "GET", "/v1/admin/schedule") for i in range(3)]
                return all(v["mode"] == mode for _, v in views)

            await wait_for(lambda: mode_is("async"), 20, "async mode everywhere", cluster)
            status, _ = await n.call(follower, "PATCH", "/v1/admin/schedule", {"mode": "sync"})
            assert status == 200
            await n.agree({"enable_schedule_async_deliver": False}, "sync mode in the config")
            assert await mode_is("sync")

            # timer_stop_* are the timer's switches, both ways; mixed with a kv key.
            await n.patch(other, {"timer_stop_dequeue": True, "log_level": "warning"})

            async def switches_are(stop_dequeue: bool) -> bool:
                views = [await n.call(i, "GET", "/v1/admin/timer") for i in range(3)]
                return all(v["switches"]["stop_dequeue"] is stop_dequeue for _, v in views)

            await wait_for(lambda: switches_are(True), 20, "dequeue stopped everywhere", cluster)
            await n.agree({"timer_stop_dequeue": True, "log_level": "warning"}, "switch on")
            status, _ = await n.call(
                follower, "POST", "/v1/admin/timer/switches", {"stop_dequeue": False}
            )
            assert status == 200
            await n.agree({"timer_stop_dequeue": False}, "the switch off shows in the config")
            assert await switches_are(False)

            # Settle on the values the restarted node must take from the cluster.
            await n.patch(leader, {"log_level": "error", "enable_schedule_async_deliver": True})
            expected = {
                "log_level": "error",
                "ops_log_sample_rate": 0.5,
                "ops_log_enabled": True,
                "enable_schedule_async_deliver": True,
                "timer_stop_dequeue": False,
            }
            await n.agree(expected, "before the restart")

        cluster.restart(follower)  # its file still says info, sync, sample rate 1.0

        async with aiohttp.ClientSession() as s:
            n = Nodes(cluster, s)

            async def back() -> bool:
                try:
                    status, view = await n.call(follower, "GET", "/v1/admin/config")
                except aiohttp.ClientError:
                    return False
                return status == 200 and view["runtime"] == expected

            await wait_for(back, 60, "the restarted node's config", cluster)
            views = await n.agree(expected, "after the restart")
            keys = views[0]["runtime_keys"]
            effective = [{k: v["config"][k] for k in keys} for v in views]
            assert effective[0] == effective[1] == effective[2], effective
            # Its log level is the cluster's: a change's INFO line is not written there.
            ends = _ends(cluster)
            await n.patch(leader, {"ops_log_sample_rate": 0.25})
            await n.agree({"ops_log_sample_rate": 0.25}, "a change after the restart")
            assert CHANGED not in _lines_after(cluster, follower, ends[follower])

    asyncio.run(go())
