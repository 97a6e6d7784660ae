"""The ``chronomq`` command line.

Tables for people by default, ``--json`` for scripts. Every bench, drill and report command
takes ``--out PATH`` and writes its figures as one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

from chronomq.cluster.cli.connect import add_client_arguments, client_call
from chronomq.cluster.cli.output import example_epilog, paragraph, print_table
from chronomq.version import VERSION

EXAMPLES = textwrap.dedent(
    """\
    examples:
      chronomq cluster up --nodes 3 --http-port 8080 --raft-port 9080 --data-dir ./var
      chronomq status --url http://127.0.0.1:8080
      chronomq produce orders --body '{"id": 1}' --delay-level 3
      chronomq consume orders --queue 0 --offset 0 --wait-ms 5000
      chronomq timer cancel 01A2003BDE67EA30FB4D291FCE2478CD
      chronomq drill --faults kill-leader,pause-leader --duration 60 --out drill.json
      chronomq report --logs ./var/ops --out report
      chronomq bench produce --nodes 3 --messages 200000 --out bench.json

    Every command has its own --help with examples.
    """
)


# ---------------------------------------------------------------------- node and cluster


def cmd_node(args: argparse.Namespace) -> int:
    from chronomq.cluster.process.launcher import parse_sets
    from chronomq.cluster.process.server import run

    return run(args.config, parse_sets(args.set))


def cmd_cluster_up(args: argparse.Namespace) -> int:
    from chronomq.cluster.config.nodeconfig import ConfigError
    from chronomq.cluster.process.launcher import LocalCluster, parse_sets
    from chronomq.cluster.process.stopping import take_signals

    try:
        cluster = LocalCluster(
            args.nodes,
            args.data_dir,
            http_port=args.http_port,
            raft_port=args.raft_port,
            settings=parse_sets(args.set),
            grpc_port=args.grpc_port,
        )
        cluster.write_configs()
    except ConfigError as exc:
        print(f"chronomq cluster up: bad configuration: {exc}", file=sys.stderr)
        return 2
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    take_signals(on_signal)
    cluster.start()
    for i in range(args.nodes):
        print(
            f"node {i}  {cluster.http_url(i)}  grpc {cluster.grpc_address(i)}  "
            f"raft 127.0.0.1:{args.raft_port + i}  catch-up 127.0.0.1:{cluster.fetch_port + i}  "
            f"log {cluster.node_dir(i) / 'node.log'}",
            flush=True,
        )
    t0 = time.monotonic()
    announced = False
    try:
        while not stopping:
            if not announced:
                try:
                    leader = cluster.wait_leader(timeout_s=0.5)
                    cluster.wait_all_know_leader(timeout_s=30)
                    print(
                        f"ready  leader node {leader} ({time.monotonic() - t0:.1f} s)", flush=True
                    )
                    announced = True
                except TimeoutError:
                    pass
                except RuntimeError as exc:
                    print(f"chronomq cluster up: {exc}", file=sys.stderr)
                    return 1
            else:
                time.sleep(0.2)
            for i in range(args.nodes):
                # Any end is news here (nothing but Ctrl-C stops a node): a bind error, a
                # storage fault, or a signal such as the out-of-memory killer's SIGKILL.
                if not stopping and i in cluster.procs and not cluster.alive(i):
                    print(f"chronomq cluster up: {cluster.exit_report(i)}", file=sys.stderr)
                    cluster.procs.pop(i)
    finally:
        print("stopping", flush=True)
        cluster.stop()
    return 0


# ---------------------------------------------------------------------- client commands


def cmd_status(args: argparse.Namespace) -> int:
    view = client_call(args, lambda c: c.cluster())
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    print(f"leader: node {view['leader']}   term: {view['term']}")
    rows = []
    for n in view["nodes"]:
        rows.append(
            {
                "id": n["id"],
                "role": n.get("role"),
                "url": n.get("http_url"),
                "commit": n.get("commit_index", "-"),
                "applied": n.get("applied_index", "-"),
                "lag": n.get("replication_lag", "-"),
                "reachable": n.get("reachable"),
                "ready": n.get("ready", "-"),
                "version": f"{n.get('version') or '-'}/w{n.get('wire_version', '-')}",
                "uptime_s": n.get("uptime_s", "-"),
                "last_election_ms": n.get("last_election_ms") or "-",
            }
        )
    print_table(
        rows,
        [
            "id",
            "role",
            "url",
            "commit",
            "applied",
            "lag",
            "reachable",
            "ready",
            "version",
            "uptime_s",
            "last_election_ms",
        ],
    )
    wires = {n.get("wire_version") for n in view["nodes"] if n.get("wire_version") is not None}
    if len(wires) > 1:
        print(
            "nodes speak different Raft wire versions and cannot form one cluster: upgrade "
            "every node to one version together"
        )
    for n in view["nodes"]:
        # What /readyz answers on that node, and why (a node can know a leader it cannot use).
        if n.get("reachable") and n.get("ready") is False:
            print(f"node {n['id']} not ready: {n.get('ready_reason')}")
    return 0


def cmd_topics(args: argparse.Namespace) -> int:
    data = client_call(args, lambda c: c.topics())
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print_table(data["topics"], ["topic", "queues", "messages"])
    return 0


def cmd_produce(args: argparse.Namespace) -> int:
    msg: dict[str, Any] = {"body": args.body}
    if args.tags:
        msg["tags"] = args.tags
    if args.keys:
        msg["keys"] = args.keys.split(",")
    for name in ("delay_level", "delay_ms", "deliver_at_ms"):
        v = getattr(args, name)
        if v is not None:
            msg[name] = v
    data = client_call(args, lambda c: c.produce(args.topic, [msg] * args.count))
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        # A delayed message waits in the schedule or timer topic until deliver_ms.
        print_table(data["results"], ["msg_id", "topic", "queue", "offset", "deliver_ms"])
    return 0


def cmd_consume(args: argparse.Namespace) -> int:
    data = client_call(
        args, lambda c: c.pull(args.topic, args.queue, args.offset, args.max, args.wait_ms)
    )
    if args.latency_log:
        from chronomq import ConsumedLog

        consumed = ConsumedLog(args.latency_log)
        consumed.consumed(args.topic, data["messages"])
        consumed.close()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print_table(data["messages"], ["msg_id", "offset", "store_ms", "reconsume_times", "body"])
        print(f"next_offset: {data['next_offset']}")
    return 0


def cmd_admin(args: argparse.Namespace) -> int:
    if args.admin_cmd == "config":
        data = client_call(args, lambda c: c.admin_config())
    elif args.admin_cmd == "set":
        from chronomq.cluster.process.launcher import parse_sets

        data = client_call(args, lambda c: c.patch_config(parse_sets(args.pairs)))
    elif args.admin_cmd == "transfer":
        data = client_call(args, lambda c: c.transfer_leadership(args.to, args.timeout_ms))
    else:
        data = client_call(args, lambda c: c.cluster())
    print(json.dumps(data, indent=2))
    return 0


# ---------------------------------------------------------------------- parser


def cmd_reference(args: argparse.Namespace) -> int:
    """``chronomq config|api reference``: print, ``--write`` or ``--check`` a docs table."""
    doc = importlib.import_module(args.doc_module)
    if args.write:
        return int(doc.main("write", args.write))
    if args.check:
        return int(doc.main("check", args.check))
    return int(doc.main())


def add_reference_command(
    sub: Any, name: str, *, help_text: str, description: str, doc_module: str, page: str
) -> None:
    """A ``chronomq NAME reference [--write FILE | --check FILE]`` command; ``page`` is the docs
    page that holds the reference."""
    parser = sub.add_parser(
        name,
        help=help_text,
        description=paragraph(description),
        epilog=example_epilog(
            f"chronomq {name} reference",
            f"chronomq {name} reference --write {page}",
            f"chronomq {name} reference --check {page}",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("what", choices=["reference"], help="what to print: the reference")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--write", metavar="FILE", help="replace the reference inside FILE")
    where.add_argument("--check", metavar="FILE", help="exit 1 if FILE's reference is stale")
    parser.set_defaults(func=cmd_reference, doc_module=doc_module)


def build_parser(extend: Callable[[Any], None] | None = None) -> argparse.ArgumentParser:
    """The node's commands; ``extend(subparsers)`` adds more (the operator tools of
    :mod:`chronomq.cli`, which sits above both packages)."""
    p = argparse.ArgumentParser(
        prog="chronomq",
        description="A Raft-replicated broker for delayed and scheduled messages.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"chronomq {VERSION}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    node = sub.add_parser(
        "node",
        help="run one broker node",
        description=paragraph("Run one broker node in the foreground until SIGTERM or Ctrl-C."),
        epilog=example_epilog(
            "chronomq node --config var/node-0/node.toml",
            "CHRONOMQ_DATA_DIR=/data CHRONOMQ_HTTP_HOST=0.0.0.0 chronomq node --set flush=sync",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    node.add_argument(
        "--config",
        required=False,
        help="TOML config file (keys may also come from CHRONOMQ_* variables)",
    )
    node.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    node.set_defaults(func=cmd_node)

    cl = sub.add_parser(
        "cluster",
        help="local clusters",
        description=paragraph("Run a cluster of local node processes on loopback."),
        epilog=example_epilog(
            "chronomq cluster up --nodes 3 --http-port 8080 --raft-port 9080 --data-dir ./var"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    clsub = cl.add_subparsers(dest="cluster_cmd", required=True, metavar="SUBCOMMAND")
    up = clsub.add_parser(
        "up",
        help="start N local nodes on loopback until Ctrl-C",
        description=paragraph(
            "Start N nodes on 127.0.0.1 and print one line per node, then 'ready' once "
            "a leader is elected. Node i keeps its config (node.toml), data and log (node.log) in "
            "DATA_DIR/node-i, so a second run restarts every node on its data. Ctrl-C or SIGTERM "
            "stops them all."
        ),
        epilog=example_epilog(
            "chronomq cluster up --nodes 3 --http-port 8080 --raft-port 9080 --data-dir ./var",
            "chronomq cluster up --nodes 5 --set flush=sync --set ops_log_dir=./var/ops",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument(
        "--http-port",
        type=int,
        default=8080,
        help="node i serves HTTP on this port + i (default 8080)",
    )
    up.add_argument(
        "--raft-port",
        type=int,
        default=9080,
        help="node i uses Raft port + i, and + 1000 for catch-up (moved on by 1000 while that "
        "would clash with another port; default 9080)",
    )
    up.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="node i serves the RocketMQ 5 gRPC endpoint on this port + i (default HTTP port + "
        "100, moved on by 100 while that would clash with another port)",
    )
    up.add_argument(
        "--data-dir", default="./var", help="node i's files go to DATA_DIR/node-i (default ./var)"
    )
    up.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="config key applied to every node"
    )
    up.set_defaults(func=cmd_cluster_up)

    def client_parser(
        name: str, help_text: str, description: str, *examples: str
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(
            name,
            help=help_text,
            description=paragraph(description),
            epilog=example_epilog(*examples),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_client_arguments(sp)
        return sp

    st = client_parser(
        "status",
        "show the cluster: roles, terms, indexes, lag",
        "Show every node as the cluster sees it: role, term, commit and applied index, "
        "replication lag, reachability, uptime and the last election's duration.",
        "chronomq status --url http://127.0.0.1:8080",
        "chronomq status --json | jq .leader",
    )
    st.set_defaults(func=cmd_status)
    tp = client_parser(
        "topics",
        "list topics",
        "List the topics with their number of queues and messages.",
        "chronomq topics",
    )
    tp.set_defaults(func=cmd_topics)
    pr = client_parser(
        "produce",
        "send a message",
        "Send a message, now or delayed: by a delay level (4.x), by delay_ms or at "
        "deliver_at_ms (timer). Prints where it was stored; a delayed message waits in the "
        "schedule or timer topic until deliver_ms.",
        "chronomq produce orders --body hello",
        "chronomq produce orders --body 'order 42 times out' --delay-level 2",
        "chronomq produce orders --body reminder --deliver-at-ms 1767225600000",
    )
    pr.add_argument("topic", help="topic to send to (created on first use by default)")
    pr.add_argument("--body", required=True, help="message body (text)")
    pr.add_argument("--tags", help="tags of the message")
    pr.add_argument("--keys", help="comma-separated keys")
    pr.add_argument("--count", type=int, default=1, help="send this many copies (default 1)")
    g = pr.add_mutually_exclusive_group()
    g.add_argument(
        "--delay-level",
        dest="delay_level",
        type=int,
        help="delay level n of message_delay_level (0: none; above the maximum: the maximum)",
    )
    g.add_argument("--delay-ms", dest="delay_ms", type=int, help="deliver this many ms from now")
    g.add_argument(
        "--deliver-at-ms",
        dest="deliver_at_ms",
        type=int,
        help="deliver at this time, in ms since the epoch",
    )
    pr.set_defaults(func=cmd_produce)
    co = client_parser(
        "consume",
        "pull messages from a queue",
        "Pull messages from one queue of a topic, from an offset, on any node; "
        "--wait-ms long-polls until a message is there.",
        "chronomq consume orders --queue 0 --offset 0 --wait-ms 5000",
        "chronomq consume orders --offset 0 --latency-log ./var/ops",
    )
    co.add_argument("topic", help="topic to read")
    co.add_argument("--queue", type=int, default=0, help="queue to read (default 0)")
    co.add_argument("--offset", type=int, default=0, help="first offset to read (default 0)")
    co.add_argument("--max", type=int, default=32, help="most messages to return (default 32)")
    co.add_argument(
        "--wait-ms",
        dest="wait_ms",
        type=int,
        default=0,
        help="wait up to this long for a message when none is there yet (default 0)",
    )
    co.add_argument(
        "--latency-log",
        dest="latency_log",
        metavar="DIR",
        help="also log the messages as consumed (latency lines for `chronomq report --logs`)",
    )
    co.set_defaults(func=cmd_consume)
    ad = client_parser(
        "admin",
        "admin operations",
        "Admin operations: the cluster view, the effective config, runtime config changes "
        "and leadership transfer. Prints JSON.",
        "chronomq admin transfer --to 1",
        "chronomq admin set log_level=debug ops_log_sample_rate=0.1",
        "chronomq admin config --url http://127.0.0.1:8081",
    )
    ad.add_argument(
        "admin_cmd",
        choices=["cluster", "config", "set", "transfer"],
        metavar="{cluster,config,set,transfer}",
        help="cluster: the cluster view; config: this node's effective config; set: change "
        "runtime keys; transfer: move leadership to --to",
    )
    ad.add_argument("pairs", nargs="*", help="for set: key=value ...")
    ad.add_argument(
        "--to", type=int, help="for transfer: target node id (default: the most caught-up)"
    )
    ad.add_argument(
        "--timeout-ms",
        dest="timeout_ms",
        type=int,
        help="for transfer: how long the leader may wait for the target to catch up and win "
        "(default 5000, at most 60000); prints the answer once the leadership has moved",
    )
    ad.set_defaults(func=cmd_admin)

    add_reference_command(
        sub,
        "config",
        help_text="the configuration reference (every key, default and environment variable)",
        description="Print the configuration reference as a Markdown table, or keep the one "
        "in a file (between its markers) current.",
        doc_module="chronomq.cluster.config.doc",
        page="docs/reference/config.md",
    )
    add_reference_command(
        sub,
        "api",
        help_text="the HTTP API reference (every route, its parameters and answer)",
        description="Print the HTTP API reference as a Markdown table, generated from the "
        "routes /openapi.json describes, or keep the one in a file (between its markers) "
        "current.",
        doc_module="chronomq.cluster.httpapi.apidoc",
        page="docs/reference/http.md",
    )

    from chronomq.cluster.cli.timer import register as register_timer

    register_timer(sub)
    if extend is not None:
        extend(sub)
    return p


def main(
    argv: list[str] | None = None,
    parser_factory: Callable[[], argparse.ArgumentParser] | None = None,
) -> int:
    parser = (parser_factory or build_parser)()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a readable line, not a stack trace, for operators
        from chronomq.errors import ApiError, ChronomqError

        if isinstance(exc, ApiError):  # without the field, as the command always said it
            print(f"chronomq: HTTP {exc.status} {exc.code}: {exc.message}", file=sys.stderr)
            return 1
        if isinstance(exc, ChronomqError | ConnectionError | OSError | TimeoutError):
            print(f"chronomq: {exc}", file=sys.stderr)
            return 1
        raise
