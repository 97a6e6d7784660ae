"""``chronomq bench models``: what the request models cost on the produce path.

Parses one produce body of ``--messages`` messages (512 by default; each with a body of about
100 bytes, a key, a tag and two properties) ``--rounds`` times, best of five, on one core, in
this process (no cluster):

- ``orjson_loads_ms``: ``orjson.loads`` of the body into dicts, what the handler paid before
  the models, ahead of any check;
- ``decode_ms``: :func:`chronomq.cluster.node.models.decode` into a ``ProduceRequest`` (JSON parsing,
  types, required and unknown fields, bounds);
- ``parse_ms``: decode plus :meth:`Broker.parse_messages` (the checks that depend on the node
  and the NewMessages it proposes), bytes in, messages out.

Prints a table and, with ``--out``, writes the figures as one JSON object.
"""

from __future__ import annotations

import argparse
import time
import types
from collections.abc import Callable
from typing import Any

import orjson

from chronomq.cluster.node import models
from chronomq.cluster.node.broker import Broker
from chronomq.ops.benchutil import positive, print_figures, progress


def produce_body(messages: int) -> bytes:
    return orjson.dumps(
        {
            "messages": [
                {
                    "body": f"order {i} timed out; customer 42 notified " + "x" * 60,
                    "keys": [f"order-{i}"],
                    "tags": "timeout",
                    "properties": {"tenant": "acme", "trace": f"t-{i}"},
                }
                for i in range(messages)
            ]
        }
    )


def _broker_stub() -> Any:
    """Just what ``parse_messages`` reads of a broker: a plain topic of 4 queues."""
    stub = types.SimpleNamespace(
        config=types.SimpleNamespace(
            auto_create_topic=True,
            max_messages_per_request=100_000,
            max_message_bytes=4 * 1024 * 1024,
            default_topic_queues=4,
        ),
        raftlog=types.SimpleNamespace(
            store=types.SimpleNamespace(queue_count=lambda topic: 4),
            clock=types.SimpleNamespace(now_ms=lambda: 1_700_000_000_000),
        ),
        _rr={},
        levels=None,
        timer_hook=None,
    )
    stub._body = types.MethodType(Broker._body, stub)
    stub._next_queue = types.MethodType(Broker._next_queue, stub)
    return stub


def _best_ms(f: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(rounds):
            f()
        best = min(best, (time.perf_counter() - t0) / rounds)
    return round(best * 1000, 3)


def run(messages: int, rounds: int) -> dict[str, Any]:
    body = produce_body(messages)
    stub = _broker_stub()

    def parse() -> object:
        request = models.decode(body, models.ProduceRequest)
        return Broker.parse_messages(stub, "orders", request.messages)

    figures: dict[str, Any] = {"messages": messages, "body_bytes": len(body)}
    timed: tuple[tuple[str, Callable[[], object]], ...] = (
        ("orjson_loads_ms", lambda: orjson.loads(body)),
        ("decode_ms", lambda: models.decode(body, models.ProduceRequest)),
        ("parse_ms", parse),
    )
    for name, f in timed:
        progress(f"{name}: best of 5 x {rounds} rounds of {messages} messages")
        figures[name] = _best_ms(f, rounds)
    return figures


def main(args: argparse.Namespace) -> int:
    figures = run(args.messages, args.rounds)
    print_figures(list(figures.items()), figures, args.out)
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "models",
        help="parse cost of the produce request model, in this process",
        description=__doc__,
        epilog="examples:\n"
        "  chronomq bench models --out models.json\n"
        "  chronomq bench models --messages 2000 --rounds 100",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--messages", type=positive, default=512, help="messages in the produce body (default 512)"
    )
    p.add_argument(
        "--rounds", type=positive, default=300, help="parses per timing, best of 5 (default 300)"
    )
    p.add_argument("--out", help="write the figures as JSON here")
    p.set_defaults(func=main)
