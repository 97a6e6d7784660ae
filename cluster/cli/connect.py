"""How a command reaches a running cluster: its ``--url``, ``--ca-file`` and ``--json``
arguments, the bearer token, and one call through the admin client."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from chronomq.aio import Client


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    """``--url``, ``--ca-file`` and ``--json``, for every command that talks to a running cluster."""
    p.add_argument(
        "--url",
        default=os.environ.get("CHRONOMQ_URL", "http://127.0.0.1:8080"),
        help="one or more node URLs, comma-separated; the next is tried when one does not "
        "answer (default $CHRONOMQ_URL or http://127.0.0.1:8080)",
    )
    p.add_argument(
        "--ca-file",
        dest="ca_file",
        default=os.environ.get("CHRONOMQ_TLS_CA_FILE") or None,
        metavar="PEM",
        help="certificates to check https node URLs against instead of the system's "
        "(default $CHRONOMQ_TLS_CA_FILE). The bearer token comes from $CHRONOMQ_AUTH_TOKEN",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def client_token() -> str | None:
    """The bearer token client commands send: ``$CHRONOMQ_AUTH_TOKEN`` (never an argument,
    where `ps` would show it)."""
    return os.environ.get("CHRONOMQ_AUTH_TOKEN") or None


def client_call(args: argparse.Namespace, fn: Any) -> Any:
    """``fn(client)`` on a :class:`Client` for the nodes of ``--url``, run to its end."""

    async def go() -> Any:
        try:
            client = Client(args.url.split(","), token=client_token(), ca_file=args.ca_file)
        except ValueError as exc:  # not an http(s) URL
            raise SystemExit(f"chronomq: {exc}") from None
        async with client as c:
            return await fn(c)

    return asyncio.run(go())
