"""``chronomq drill``: run a workload against a fresh local cluster, inject faults, check.

The cluster is started by the drill, on loopback, or (when a partition fault is asked for and
the drill runs as root) with each node in its own network namespace. Faults run one at a
time: a warm-up, then each fault of ``--faults`` in turn (in an order drawn from ``--seed``),
each followed by a quiet period, until ``--duration`` is over (each fault asked for runs at
least once, also when that takes longer). Producers then stop, the
consumers drain, and the checker reads the history. The churn faults need no root:
``transfer-leader`` moves the leadership 3-5 times in a row and ``membership`` removes a
follower while it runs and adds it back; the RTO table then also gives, per fault, the time
each disruption left the cluster without a leader.

Everything the drill creates (processes, namespaces, bridge, nftables rules, clock-skew files)
is removed when it ends, also on Ctrl-C or failure. The output directory keeps the history
(``history.jsonl``), every node's ops logs (``logs/n<i>``) and the drill's fault events
(``logs/drill``), so ``chronomq report --logs OUT/logs --out REPORT`` shows the failover windows.

``--client http`` (the default) produces and pulls over the HTTP API; ``--client grpc`` sends
with the official RocketMQ 5 ``Producer`` and receives and acks with its ``SimpleConsumer``
(pop consumption), see :mod:`chronomq.ops.drill.grpc_workload`. The checker is the same.

Exit status: 0 when every fault asked for ran and nothing was lost, repeated, early or invented;
1 on a safety violation (or replicas that did not converge, a node that failed); 2 when a
fault asked for did not run (it cannot run here, or the drill stopped before it), naming each
and why, or on a bad argument; 3 when the cluster could not be started. The JSON's ``safe`` is
true only when every fault asked for ran and nothing unsafe was found. ``--allow-skip`` accepts such
a drill: exit 0 when what ran was safe (``safe`` stays false, ``faults_not_run`` says why).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chronomq.aio import Client
from chronomq.cluster.cli.output import print_rows, write_json
from chronomq.cluster.process.launcher import STOP_TIMEOUT_S, LocalCluster, parse_sets
from chronomq.errors import RequestError
from chronomq.ops.drill import faults as faultlib
from chronomq.ops.drill import netns
from chronomq.ops.drill.admin import STATUS_TIMEOUT_S
from chronomq.ops.drill.checker import SAFETY, check
from chronomq.ops.drill.context import blocking
from chronomq.ops.drill.grpc_workload import GrpcWorkload
from chronomq.ops.drill.history import History, now_ms, read_history
from chronomq.ops.drill.interrupt import (
    GRPC_CLOSE_S,
    INTERRUPT_NODE_STOP_S,
    TASKS_STOP_S,
    DrillState,
    Stopper,
)
from chronomq.ops.drill.interrupt import progress as _progress
from chronomq.ops.drill.powercut import mount as powercut
from chronomq.ops.drill.workload import TOPIC, Workload, WorkloadConfig
from chronomq.schedule.levels import DelayLevelTable

DRILL_SETTINGS = {
    "message_delay_level": "1s 2s 3s 5s",
    "enable_schedule_async_deliver": "true",
}
ASYNC_FLUSH_INTERVAL_MS = 500
"""The loss bound the docs state for ``flush = async`` when every node loses power: what was
acknowledged within the last CommitLog flush interval."""
WARMUP_S = 4.0
QUIET_S = 4.0


def _event_writer(directory: Path) -> Any:
    try:
        from chronomq.cluster.logs.writer import LogWriter
    except ImportError:  # pragma: no cover - ops is always installed with the drill
        return None
    return LogWriter(directory, "drill").start()


def _record_event(writer: Any, detail: dict[str, Any]) -> None:
    if writer is None:
        return
    from chronomq.cluster.logs.schema import EventRecord, EventType

    writer.write(
        EventRecord(ts_ms=now_ms(), node="drill", type=EventType.DRILL_FAULT, detail=detail)
    )


async def _timers_supported(client: Client) -> bool:
    try:
        # Its own topic: the consumers of the drill's topic must not see it.
        await client.produce(
            f"{TOPIC}-probe", [{"body": "probe", "deliver_at_ms": now_ms() + 60_000}]
        )
    except RequestError as exc:
        if exc.status == 400:
            return False
        raise
    return True


def plan_faults(
    names: list[str], duration_s: float, hold_s: float, rng: random.Random
) -> list[str]:
    """The faults to run in order: each name once in turn (order from ``rng``), repeated to fill
    ``duration_s``."""
    per_fault = hold_s + QUIET_S + 2.0
    slots = max(len(names), int((duration_s - WARMUP_S) // per_fault))
    order: list[str] = []
    while len(order) < slots:
        batch = list(names)
        rng.shuffle(batch)
        order.extend(batch)
    return order[:slots]


async def _drill(
    args: argparse.Namespace,
    out: Path,
    cluster: LocalCluster,
    ctx_net: Any,
    state: DrillState,
    disks: dict[int, powercut.PowerCutMount] | None = None,
) -> None:
    """The workload, the faults and the drain; what it finds goes to ``state.found``.

    Cancelled (Ctrl-C), it stops its workload and closes the history within
    :data:`TASKS_STOP_S` + :data:`GRPC_CLOSE_S`; the faults' healers are left to the drill's
    clean-up, which removes what they would restore."""
    # Separate streams: the workload draws as fast as acknowledgements come back, which
    # must not move the faults' choices (order, skew amounts) for a given seed.
    rng = random.Random(f"{args.seed}/faults")
    workload_rng = random.Random(f"{args.seed}/workload")
    history = History(out / "history.jsonl")
    events = _event_writer(out / "logs")
    stop_consumers = asyncio.Event()
    workload: Workload | GrpcWorkload | None = None
    tasks: list[asyncio.Task[Any]] = []
    try:
        async with Client(
            cluster.urls,
            token=cluster.auth_token,
            ca_file=cluster.ca_file,
            deadline_s=10,
            request_timeout_s=2.5,
        ) as client:
            try:
                await state.enter("waiting for a leader")
                await faultlib.wait_leader(cluster, 60)
                workload = await _start_workload(args, cluster, client, history, workload_rng)
                consumers = workload.start_consumers(stop_consumers)
                tasks.extend(consumers)
                ctx = faultlib.FaultContext(
                    cluster=cluster,
                    rng=rng,
                    network=ctx_net,
                    record=_recorder(history, events),
                    burst=workload.burst,
                    hold_s=args.hold,
                    disks=disks,
                    enter=state.enter,
                )
                order = _plan(args, ctx, state.found)
                producing = asyncio.create_task(workload.run_producers(args.duration))
                tasks.append(producing)
                await _run_faults(args, ctx, order, state)
                await producing
                await workload.wait_cancels()
                await _drain(workload, history, state)
                stop_consumers.set()
                await asyncio.gather(*consumers, return_exceptions=True)
                await _converge(workload, cluster, state)
            finally:
                # Before the client closes: a consumer still reading would fail on it.
                stop_consumers.set()
                await _stop_tasks([*tasks, *(workload.cancel_tasks if workload else [])])
    finally:
        try:
            if isinstance(workload, GrpcWorkload):
                try:
                    await asyncio.wait_for(workload.close(), GRPC_CLOSE_S)
                except TimeoutError:
                    _progress(f"the gRPC clients did not shut down within {GRPC_CLOSE_S:.0f} s")
        finally:
            history.close()
            if events is not None:
                events.close()


async def _start_workload(
    args: argparse.Namespace,
    cluster: LocalCluster,
    client: Client,
    history: History,
    rng: random.Random,
) -> Workload | GrpcWorkload:
    """The HTTP or gRPC workload, started (timers left out where the broker refuses them)."""
    kinds = ["plain", "level", "timer"]
    if not await _timers_supported(client):
        _progress("this broker does not accept timers (deliver_at_ms); skipping them")
        kinds.remove("timer")
    config = WorkloadConfig(rate=args.rate, kinds=tuple(kinds))
    if args.client != "grpc":
        return Workload(client, history, rng, args.seed, config)
    workload = GrpcWorkload(
        cluster.grpc_endpoints,
        history,
        rng,
        args.seed,
        _level_delays_ms(args),
        token=cluster.auth_token,
        config=config,
    )
    try:
        await workload.start()
    except BaseException:
        await asyncio.wait_for(workload.close(), GRPC_CLOSE_S)
        raise
    return workload


async def _note_election(ctx: faultlib.FaultContext, name: str, since_ms: int, leader: int) -> None:
    """Record what made ``leader`` campaign, when it was elected during fault ``name``: its
    status says ``detected_by`` (connection_closed, timeout, transfer) in its leader changes."""
    status = await blocking(ctx.cluster.node_status, leader, STATUS_TIMEOUT_S)
    for change in reversed((status or {}).get("leader_changes") or []):
        if int(change.get("at_ms") or 0) < since_ms:
            break
        if change.get("to") == leader and change.get("detected_by"):
            ctx.record("elected", fault=name, node=leader, detected_by=change["detected_by"])
            return


def _recorder(history: History, events: Any) -> Callable[..., None]:
    """A fault's ``record(type, **detail)``: to the history, the drill's event log and, for
    starts and disruptions, a progress line."""

    def record(type_: str, **detail: Any) -> None:
        rec = history.add("fault", type_, **detail)
        _record_event(
            events, {"phase": type_, **{k: v for k, v in rec.items() if k not in ("op", "type")}}
        )
        if type_ == "start":
            _progress(f"fault {detail.get('fault')} {detail}")
        elif type_ == "disruption":
            _progress(f"  {detail.get('fault')} {detail.get('step')}: {_brief(detail)}")

    return record


def _plan(args: argparse.Namespace, ctx: faultlib.FaultContext, found: dict[str, Any]) -> list[str]:
    """The faults to run, in order (those that cannot run here are skipped, each said once);
    the plan goes to ``found``, with the lists the fault loop fills."""
    skipped: dict[str, str] = {}
    runnable = []
    for name in args.faults:
        why = faultlib.unavailable_reason(name, ctx.network, args.skew_ready, ctx.disks)
        if why:
            skipped[name] = why
            _progress(f"skipping {name}: {why}")
        else:
            runnable.append(name)
    order = plan_faults(runnable, args.duration, args.hold, ctx.rng) if runnable else []
    found.update(
        skipped_faults=skipped,
        faults_planned=order,
        faults_run=[],
        findings=[],
        skew_allowance_ms=0,
    )
    if ctx.disks:
        found["power_cuts"] = []
    _progress(f"seed {args.seed}; faults in order: {', '.join(order) or 'none'}")
    return order


async def _run_faults(
    args: argparse.Namespace, ctx: faultlib.FaultContext, order: list[str], state: DrillState
) -> None:
    """The warm-up, then each fault of ``order`` and a quiet period after it, until the
    drill's duration is over and each fault of ``order`` ran once; each fault healed before the
    next."""
    found = state.found
    started = time.monotonic()
    await state.enter("warm-up")
    await asyncio.sleep(WARMUP_S)
    try:
        for name in order:
            over = time.monotonic() - started > args.duration
            if over and set(order) <= set(found["faults_run"]):
                break
            await state.enter(f"fault {name}")
            since_ms = now_ms()
            detail = await faultlib.inject(name, ctx)
            found["faults_run"].append(name)
            if name in faultlib.POWER:
                found["power_cuts"].append(detail)
            found["findings"].extend(f"{name}: {f}" for f in detail.get("findings", []))
            found["skew_allowance_ms"] = ctx.skew_ms + 50 if ctx.skew_ms else 0
            await state.enter("quiet")
            leader = await faultlib.wait_leader(ctx.cluster, 60)
            await _note_election(ctx, name, since_ms, leader)
            await asyncio.sleep(QUIET_S)
    except (RuntimeError, TimeoutError) as exc:
        # A node that exits by itself, or a cluster that stays leaderless, ends the faults;
        # the history is still checked and the run fails.
        found["aborted"] = str(exc)
        _progress(f"faults stopped: {exc}")
    finally:
        # Not when interrupted: the clean-up removes whatever the healers restore (a re-add
        # alone may take seconds), and must not wait for them.
        if not state.interrupted:
            for heal in list(ctx.healers):
                heal()


async def _drain(workload: Workload | GrpcWorkload, history: History, state: DrillState) -> None:
    """Let the consumers read what was acknowledged, then past a sentinel per queue."""
    await state.enter("draining")
    _progress(f"producers stopped after {history.count} records; draining")
    drain_deadline = time.monotonic() + 60
    while workload.outstanding() and time.monotonic() < drain_deadline:
        await asyncio.sleep(0.2)
    # A late duplicate must show up before judging: a sentinel per queue, written after
    # everything else, and the consumers reading past it, say the queues were read to their
    # ends.
    await workload.read_past_sentinels(deadline_s=30)


async def _converge(
    workload: Workload | GrpcWorkload, cluster: LocalCluster, state: DrillState
) -> None:
    """Wait for the replicas to agree, and read the converged log again from the start."""
    await state.enter("converging")
    try:
        await faultlib.wait_converged(cluster, 60)
        state.found["replicas_converged"] = True
        # What the converged log holds, read again from the start (the HTTP workload's
        # consumers read by offset; pop consumption has no offsets to read again, its acks
        # are the record).
        if isinstance(workload, Workload):
            state.found["final_read"] = await workload.final_read()
    except TimeoutError as exc:
        state.found["replicas_converged"] = False
        _progress(f"replicas differ: {exc}")


async def _stop_tasks(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel the workload's tasks that still run (interrupted: nothing waits for them any
    more) and give them :data:`TASKS_STOP_S` to end; what they raised is not logged again."""
    running = [t for t in tasks if not t.done()]
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running, timeout=TASKS_STOP_S)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()


def _level_delays_ms(args: argparse.Namespace) -> tuple[int, ...]:
    """The delay-level table the drill's nodes run with (``--set`` may replace it)."""
    text = parse_sets(args.set).get("message_delay_level", DRILL_SETTINGS["message_delay_level"])
    return DelayLevelTable.parse(text).delays_ms


def _brief(detail: dict[str, Any]) -> str:
    """A disruption's progress line: its answer and what followed, without the repeats."""
    keep = {k: v for k, v in detail.items() if k not in ("fault", "step", "t_ms") and v is not None}
    return " ".join(f"{k}={v}" for k, v in keep.items())


def run(args: argparse.Namespace, state: DrillState | None = None) -> dict[str, Any]:
    """Run the drill; its result, partial (``interrupted``) when Ctrl-C stopped it."""
    state = state or DrillState()
    stopper = Stopper(state)
    # Before anything is made that the handler must remove.
    stopper.install()
    try:
        return _run(args, state, stopper)
    finally:
        stopper.restore()


def _run(args: argparse.Namespace, state: DrillState, stopper: Stopper) -> dict[str, Any]:
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="chronomq-drill-")).absolute()
    out.mkdir(parents=True, exist_ok=True)
    network = None
    want_net = any(f in faultlib.PARTITIONS for f in args.faults)
    if want_net:
        ok, why = netns.available()
        if ok:
            network = netns.Network(args.nodes)
        else:
            _progress(why)
    args.skew_ready = "clock-skew" in args.faults
    settings = {**DRILL_SETTINGS, "ops_log_dir": str(out / "logs"), **parse_sets(args.set)}
    node_dirs = out / "nodes"
    disks: dict[int, powercut.PowerCutMount] | None = None
    if any(f in faultlib.POWER for f in args.faults):
        ok, why = powercut.available()
        if ok:
            # node-i/data (the node's data_dir) is the mount; its files live in node-i/disk.
            disks = {
                i: powercut.PowerCutMount(
                    node_dirs / f"node-{i}" / "data",
                    node_dirs / f"node-{i}" / "disk",
                    log_path=node_dirs / f"node-{i}" / "disk.log",
                )
                for i in range(args.nodes)
            }
        else:
            _progress(why)
    cluster = LocalCluster(
        args.nodes,
        node_dirs,
        http_port=args.http_port,
        raft_port=args.raft_port,
        settings=settings,
        hosts=network.hosts if network else None,
        prefix=network.prefix if network else None,
        node_env={i: faultlib.skew_env(node_dirs / f"node-{i}") for i in range(args.nodes)}
        if args.skew_ready
        else None,
    )
    stopper.cluster, stopper.network, stopper.disks = cluster, network, disks or {}
    try:
        state.enter_blocking("starting")
        if network is not None:
            network.setup()
        for disk in (disks or {}).values():
            disk.start()
        cluster.start()
        _progress(
            f"{args.nodes} nodes up ({'network namespaces' if network else 'loopback'}); "
            f"running {args.duration:.0f} s"
        )
        stopper.run_loop(_drill(args, out, cluster, network, state, disks))
    except KeyboardInterrupt:
        if not state.interrupted:
            raise
    finally:
        # From here a Ctrl-C only notes (a second one, or the watchdog, exits at once).
        stopper.mode = "note"
        state.enter_blocking("stopping")
        try:
            cluster.stop(INTERRUPT_NODE_STOP_S if state.interrupted else STOP_TIMEOUT_S, final=True)
        finally:
            # After the nodes: a mount still in use would only be detached lazily.
            for disk in (disks or {}).values():
                disk.stop()
            if network is not None:
                network.teardown()
    history_path = out / "history.jsonl"
    result: dict[str, Any] = {
        "nodes": args.nodes,
        "client": args.client,
        "seed": args.seed,
        "duration_s": args.duration,
        "skipped_faults": {},
        "faults_planned": [],
        "faults_run": [],
        "findings": [],
        "skew_allowance_ms": 0,
        "faults": [],
        **state.found,
        "out_dir": str(out),
        "history": str(history_path),
    }

    def judge() -> None:
        checked = check(
            read_history(history_path),
            skew_allowance_ms=result["skew_allowance_ms"],
            delivery="pop" if args.client == "grpc" else "pull",
        )
        result.update(checked.as_dict())
        if "power_cuts" in result:
            result["power_cut_summary"] = _power_summary(result)

    if state.interrupted is None:
        stopper.mode = "raise"
        try:
            state.enter_blocking("checking")
            judge()
        except KeyboardInterrupt:
            if not state.interrupted:
                raise
        finally:
            stopper.mode = "note"
    elif history_path.exists():
        judge()  # interrupted before the checker: the history so far, judged as it is
    if state.interrupted is not None:
        result["interrupted"] = {
            "signal": state.signal_number,
            "phase": state.interrupted,
            "after_s": state.interrupted_after_s,
            "checked": "produced" in result,
        }
    return result


def _power_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Power cuts by scope, the messages each lost, and the loss window against the bound."""
    cuts = [f for f in result["faults"] if f.get("fault") == "power-cut"]
    windows = [f["lost_acked_ms_before"]["max"] for f in cuts if f.get("lost_acked_ms_before")]
    gone = [f["gone_acked_ms_before"]["max"] for f in cuts if f.get("gone_acked_ms_before")]
    by_scope: dict[str, dict[str, int]] = {}
    for f in cuts:
        row = by_scope.setdefault(str(f.get("scope")), {"cuts": 0, "lost": 0, "gone": 0})
        row["cuts"] += 1
        row["lost"] += int(f.get("lost", 0))
        row["gone"] += int(f.get("gone", 0))
    return {
        "cuts": len(cuts),
        "by_scope": by_scope,
        "lost": sum(int(f.get("lost", 0)) for f in cuts),
        "lost_acked_ms_before_cut_max": max(windows) if windows else None,
        "gone": sum(int(f.get("gone", 0)) for f in cuts),
        "gone_acked_ms_before_cut_max": max(gone) if gone else None,
        "async_bound_ms": ASYNC_FLUSH_INTERVAL_MS,
    }


def _interrupted(result: dict[str, Any], out: str | None) -> int:
    """The partial report of a drill stopped by Ctrl-C: what the history held when it
    stopped (a message acknowledged and not read yet counts as lost there), and where the
    history and logs are kept (also a temporary directory is kept)."""
    how = result["interrupted"]
    print(
        f"interrupted during {how['phase']} after {how['after_s']} s: partial report "
        "(acknowledged messages not read before the interrupt count as lost)"
    )
    if how["checked"]:
        _table(result)
    else:
        print_rows([("nodes", result["nodes"]), ("seed", result["seed"])])
    print(f"faults run: {', '.join(result['faults_run']) or 'none'}")
    result["safe"] = False  # a partial run shows nothing safe
    write_json(result, out)
    print(
        f"chronomq drill: interrupted; everything it started was stopped; history and logs "
        f"in {result['out_dir']}",
        file=sys.stderr,
    )
    return 128 + int(how["signal"] or signal.SIGINT)


def _table(result: dict[str, Any]) -> None:
    rows: list[tuple[str, Any]] = [
        ("nodes", result["nodes"]),
        ("seed", result["seed"]),
        ("produced", result["produced"]),
        ("acknowledged", result["acknowledged"]),
        ("produce errors", result.get("produce_errors", 0)),
        ("consumed", result["consumed"]),
        *[(name, result[name]) for name in SAFETY],
        ("recovered", result["recovered"]),
        *[(name, result[name]) for name in ("redelivered", "unacked") if name in result],
        ("cancelled", result["cancelled"]),
        ("lateness p50/p99/max ms", "{p50} / {p99} / {max}".format(**result["lateness_ms"])),
        ("replicas converged", result.get("replicas_converged")),
    ]
    if result.get("duplicated_after_loss"):
        rows.append(("duplicated after a loss", result["duplicated_after_loss"]))
    if result.get("rewinds"):
        # Every node lost its newest entries (flush = async): consumers were told (prev).
        rows.append(("consumer rewinds", result["rewinds"]))
    print_rows(rows)
    for name, why in result.get("faults_not_run", {}).items():
        print(f"fault not run: {name}: {why}")
    for finding in result.get("findings", []):
        print(f"finding: {finding}")
    if result.get("power_cut_summary"):
        _power_table(result)
    if result["rto_s"]:
        print()
        print(
            f"{'fault'.ljust(18)}  {'n':>3}  {'RTO min':>8}  {'median':>8}  {'max':>8}  "
            f"{'produce median':>14}  {'leaderless median/max':<21}  detected by"
        )
        for name, r in result["rto_s"].items():
            p = result["produce_rto_s"].get(name, {})
            gap = result.get("leaderless_s", {}).get(name)
            gaps = f"{gap['median']} / {gap['max']}" if gap else "-"
            print(
                f"{name.ljust(18)}  {r['n']:>3}  {r['min']!s:>8}  {r['median']!s:>8}  "
                f"{r['max']!s:>8}  {p.get('median')!s:>14}  {gaps:<21}  "
                + _detected(result.get("detected_by", {}).get(name))
            )


def _detected(counts: dict[str, int] | None) -> str:
    """``connection_closed 8, timeout 1``: how the new leaders noticed, over a fault's
    elections; ``-`` when none was elected."""
    if not counts:
        return "-"
    return ", ".join(f"{cause} {n}" for cause, n in counts.items())


def _power_table(result: dict[str, Any]) -> None:
    summary = result["power_cut_summary"]
    cuts = [f for f in result["faults"] if f.get("fault") == "power-cut"]
    details = result.get("power_cuts", [])
    print()
    print(
        f"{'power cut':<10} {'scope':<9} {'nodes':<10} {'lost':>5}  acked before cut (ms)  "
        f"{'gone':>5}  acked before cut (ms)  disk"
    )
    for k, f in enumerate(cuts):
        window = f.get("lost_acked_ms_before")
        span = f"{window['min']}..{window['max']}" if window else "-"
        gone_window = f.get("gone_acked_ms_before")
        gone_span = f"{gone_window['min']}..{gone_window['max']}" if gone_window else "-"
        disk = ""
        if k < len(details):
            per_node = details[k].get("cut", {}).values()
            disk = "files reverted {}, entries lost {}".format(
                sum(c["files_reverted"] for c in per_node),
                sum(c["entries_lost"] for c in per_node),
            )
        nodes = ",".join(str(n) for n in f.get("nodes", []))
        print(
            f"{k + 1:<10} {f.get('scope')!s:<9} {nodes:<10} {f.get('lost', 0):>5}  {span:<21}  "
            f"{f.get('gone', 0):>5}  {gone_span:<21}  {disk}"
        )
    gone_window = summary.get("gone_acked_ms_before_cut_max")
    print(
        f"gone from the log: {summary.get('gone', 0)} acknowledged messages"
        + (
            f", acknowledged up to {gone_window} ms before the cut that took them "
            f"(flush=async bound in the docs: {summary['async_bound_ms']} ms)"
            if gone_window is not None
            else ""
        )
        + (
            f"; the other {summary['lost'] - summary.get('gone', 0)} lost are in the log, "
            "but no consumer read them"
            if summary["lost"] > summary.get("gone", 0)
            else ""
        )
    )
    window = summary["lost_acked_ms_before_cut_max"]
    print(
        f"{summary['cuts']} power cuts lost {summary['lost']} acknowledged messages"
        + (
            f", acknowledged up to {window} ms before the cut "
            f"(flush=async bound in the docs: {summary['async_bound_ms']} ms)"
            if window is not None
            else ""
        )
    )


def main(args: argparse.Namespace) -> int:
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 10**6)
    print(f"seed {args.seed}", file=sys.stderr, flush=True)
    if args.client == "grpc" and parse_sets(args.set).get("tls_cert_file"):
        print("chronomq drill: --client grpc does not speak TLS yet", file=sys.stderr)
        return 2
    unknown = [f for f in args.faults if f not in faultlib.KNOWN_FAULTS]
    if unknown:
        print(
            f"chronomq drill: unknown fault {unknown[0]!r}; choose from {', '.join(faultlib.KNOWN_FAULTS)}",
            file=sys.stderr,
        )
        return 2
    try:
        result = run(args)
    except KeyboardInterrupt:
        print("chronomq drill: interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        # A node that would not start or stay up (a port taken by another cluster or drill,
        # a disk that cannot be mounted): the drill could not run; everything was stopped.
        print(
            f"chronomq drill: could not run: {exc} (another drill or cluster on the same "
            "ports? see --http-port and --raft-port)",
            file=sys.stderr,
        )
        return 3
    if result.get("interrupted"):
        return _interrupted(result, args.out)
    not_run = faults_not_run(args.faults, result)
    result["faults_not_run"] = not_run
    safe = all(result[name] == 0 for name in SAFETY)
    converged = result.get("replicas_converged", False) and not result.get("aborted")
    result["safe"] = safe and converged and not not_run
    _table(result)
    write_json(result, args.out)
    if not args.keep and args.out_dir is None:
        shutil.rmtree(result["out_dir"], ignore_errors=True)
    if not converged:
        print(
            f"chronomq drill: replicas did not converge or a node failed "
            f"(seed {args.seed}): {result.get('aborted') or 'digests differ'}",
            file=sys.stderr,
        )
    if not safe:
        print(
            f"chronomq drill: SAFETY VIOLATION (seed {args.seed}); examples: {result['examples']}",
            file=sys.stderr,
        )
    if not (safe and converged):
        return 1
    if not_run:
        what = "; ".join(f"{name}: {why}" for name, why in not_run.items())
        if args.allow_skip:
            print(
                f"chronomq drill: faults not run, allowed by --allow-skip ({what}); what ran "
                "was safe, the JSON's safe is false",
                file=sys.stderr,
            )
            return 0
        print(
            f"chronomq drill: FAULTS NOT RUN, so not shown safe ({what}); --allow-skip "
            "accepts a drill that runs only some of its faults",
            file=sys.stderr,
        )
        return 2
    return 0


def faults_not_run(asked: list[str], result: dict[str, Any]) -> dict[str, str]:
    """Each fault of ``asked`` that did not run, and why."""
    ran = set(result.get("faults_run", []))
    skipped: dict[str, str] = result.get("skipped_faults", {})
    why_stopped = (
        f"the drill's faults stopped before it: {result['aborted']}"
        if result.get("aborted")
        else "the drill ended before it"
    )
    return {
        name: skipped.get(name, why_stopped) for name in dict.fromkeys(asked) if name not in ran
    }


def _faults_arg(text: str) -> list[str]:
    names = [f.strip() for f in text.split(",") if f.strip()]
    if names == ["all"]:
        return list(faultlib.ALL_FAULTS)
    return names


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "drill",
        help="failover drill: workload + faults + delivery checker",
        description=__doc__
        + "\nfaults: "
        + ", ".join(faultlib.KNOWN_FAULTS)
        + " ('all': every one but power-cut)",
        epilog="examples:\n"
        "  chronomq drill --nodes 3 --faults kill-leader,kill-follower,pause-leader "
        "--duration 60 --seed 7 --out drill.json\n"
        "  chronomq drill --nodes 3 --faults transfer-leader,membership --duration 60 --seed 7\n"
        "  chronomq drill --client grpc --faults kill-leader --duration 30 --seed 7\n"
        "  sudo chronomq drill --nodes 5 --faults all --duration 600 --out drill5.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", type=int, choices=[3, 5], default=3, help="cluster size (default 3)")
    p.add_argument(
        "--faults",
        type=_faults_arg,
        default=["kill-leader", "kill-follower", "pause-leader"],
        help="comma-separated fault names, or 'all'",
    )
    p.add_argument("--duration", type=float, default=60.0, help="seconds of workload")
    p.add_argument("--seed", type=int, default=None, help="makes the fault order repeatable")
    p.add_argument(
        "--client",
        choices=["http", "grpc"],
        default="http",
        help="http: produce and pull over the HTTP API (default); grpc: the official "
        "RocketMQ 5 Producer and SimpleConsumer (receive and ack)",
    )
    p.add_argument("--rate", type=float, default=100.0, help="messages per second")
    p.add_argument(
        "--hold", type=float, default=faultlib.DEFAULT_HOLD_S, help="seconds a fault lasts"
    )
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--out-dir", dest="out_dir", help="keep history and logs here")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument(
        "--http-port",
        dest="http_port",
        type=int,
        default=23080,
        help="node i serves HTTP on this port + i (default 23080)",
    )
    p.add_argument(
        "--raft-port",
        dest="raft_port",
        type=int,
        default=24080,
        help="node i uses Raft port + i, and + 1000 for catch-up (default 24080)",
    )
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="extra node config")
    p.add_argument(
        "--allow-skip",
        dest="allow_skip",
        action="store_true",
        help="exit 0 when a fault asked for could not run here but what ran was safe (without "
        "it such a drill exits 2); the JSON's safe stays false",
    )
    p.set_defaults(func=main)
