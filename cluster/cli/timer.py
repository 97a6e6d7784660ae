"""``chronomq timer ...``: cancel a timer message, show the timer, stop or start it.

Registered by :func:`chronomq.cluster.cli.commands.build_parser`; every command talks to the cluster through
:class:`chronomq.aio.Client` (writes find the leader).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from chronomq.cluster.cli.connect import add_client_arguments, client_call
from chronomq.cluster.cli.output import example_epilog, paragraph, print_rows, print_table


def cmd_cancel(args: argparse.Namespace) -> int:
    answers = [client_call(args, lambda c, m=m: c.cancel_timer(m)) for m in args.msg_ids]
    if args.json:
        print(json.dumps(answers, indent=2))
    else:
        print_table(answers, ["msg_id", "status", "deliver_ms", "reason"])
    # 0 when every message is cancelled: scripts can tell a cancel that came too late.
    return 0 if all(a["status"] == "cancelled" for a in answers) else 3


def cmd_status(args: argparse.Namespace) -> int:
    data = client_call(args, lambda c: c.timer_status(args.url.split(",")[0]))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [
        ("role", data["role"]),
        ("backlog", data["backlog"]["total"]),
        ("read_behind_ms", data["read_behind_ms"]),
        ("offset_behind", data["offset_behind"]),
        ("enqueue_per_s", data["rates"]["enqueue_per_s"]),
        ("dequeue_per_s", data["rates"]["dequeue_per_s"]),
        ("stop_enqueue", data["switches"]["stop_enqueue"]),
        ("stop_dequeue", data["switches"]["stop_dequeue"]),
        ("rejected", data["congestion"]["rejected"]),
        ("cursor_slot_ms", (data["cursor"] or {}).get("slot_ms")),
        ("checkpoint_index", (data["checkpoint"] or {}).get("applied_index")),
    ]
    rows += [(f"total_{k}", v) for k, v in data["totals"].items()]
    width = print_rows(rows)
    for topic, n in data["backlog"]["by_topic"].items():
        print(f"{'backlog ' + topic:<{width}}  {n}")
    return 0


def cmd_switch(args: argparse.Namespace) -> int:
    stop = args.timer_cmd == "stop"
    both = not args.enqueue and not args.dequeue
    changes = {
        "stop_enqueue": stop if (args.enqueue or both) else None,
        "stop_dequeue": stop if (args.dequeue or both) else None,
    }
    data = client_call(args, lambda c: c.timer_switches(**changes))
    print(json.dumps(data["switches"]))
    return 0


def register(sub: Any) -> None:
    tp = sub.add_parser(
        "timer",
        help="timer messages: cancel, status, stop/start delivery",
        description=paragraph(
            "Timer messages (any deliver time, RocketMQ 5.x style): cancel them, look "
            "at the timer, stop or start it."
        ),
        epilog="examples:\n"
        "  chronomq timer cancel 01A2003BDE67EA30FB4D291FCE2478CD\n"
        "  chronomq timer status --url http://127.0.0.1:8081\n"
        "  chronomq timer stop --dequeue\n"
        "  chronomq timer start",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tsub = tp.add_subparsers(dest="timer_cmd", required=True, metavar="SUBCOMMAND")

    cancel = tsub.add_parser(
        "cancel",
        help="cancel timer messages by msg_id (exit 3 unless all are cancelled)",
        description=paragraph(
            "Cancel timer messages (produced with delay_ms or deliver_at_ms) by the "
            "msg_id their produce returned. Each answer is 'cancelled' (it will never be "
            "delivered), 'delivered' (too late) or 'unknown'. Exits 0 when every one is "
            "cancelled, 3 otherwise."
        ),
        epilog=example_epilog(
            "chronomq timer cancel 01A2003BDE67EA30FB4D291FCE2478CD",
            "chronomq timer cancel ID1 ID2 --json",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cancel.add_argument("msg_ids", nargs="+", metavar="MSG_ID", help="msg_id of a timer message")
    add_client_arguments(cancel)
    cancel.set_defaults(func=cmd_cancel)
    status = tsub.add_parser(
        "status",
        help="backlog, read-behind, rates, switches of one node",
        description=paragraph(
            "The timer as one node sees it: backlog (total and per topic), how far "
            "delivery is behind, enqueue and dequeue rates, the stop switches, congestion "
            "rejections, the read cursor and the checkpoint."
        ),
        epilog=example_epilog(
            "chronomq timer status --url http://127.0.0.1:8081",
            "chronomq timer status --json",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_client_arguments(status)
    status.set_defaults(func=cmd_status)
    for name, verb in (("stop", "stop"), ("start", "start")):
        sw = tsub.add_parser(
            name,
            help=f"{verb} timer enqueue and/or delivery cluster-wide (both by default)",
            description=paragraph(
                f"{verb.capitalize()} putting timer messages into the wheel "
                "(--enqueue) and/or delivering them (--dequeue), on every node: the switches are "
                "replicated, so a new leader keeps them. Without either option, both."
            ),
            epilog=example_epilog(f"chronomq timer {name}", f"chronomq timer {name} --dequeue"),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sw.add_argument("--enqueue", action="store_true", help=f"{verb} putting into the wheel")
        sw.add_argument("--dequeue", action="store_true", help=f"{verb} delivering")
        add_client_arguments(sw)
        sw.set_defaults(func=cmd_switch)
