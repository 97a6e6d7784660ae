"""The chronomq Python client.

``chronomq.Producer`` and ``chronomq.Consumer`` are synchronous (threads; Django, Flask,
scripts); ``chronomq.aio.Producer`` and ``chronomq.aio.Consumer`` run on asyncio. Both talk
to the nodes' HTTP API: give them every node's URL.

    import chronomq

    with chronomq.Producer(["http://127.0.0.1:8080", "http://127.0.0.1:8081"]) as producer:
        sent = producer.send("orders", "order 42 times out", delay_ms=30 * 60 * 1000)
        producer.cancel(sent.msg_id)        # paid after all

``chronomq.aio.Client`` calls any route of the HTTP API, the admin ones included, one request
per call.

The library imports only its own modules, ``chronomq.version`` and the ops-log format it
writes latency logs in (``chronomq.cluster.logs``); the ``chronomq`` command (``chronomq.cli``)
sits above every package (``tests/test_layering.py`` checks both).
"""

from chronomq._latency import ConsumedLog
from chronomq._model import CancelResult, MessageData, SendResult
from chronomq._sync import Consumer, Message, Producer
from chronomq.errors import (
    ApiError,
    ChronomqError,
    RequestError,
    ServerError,
    UnavailableError,
)

__all__ = [
    "ApiError",
    "CancelResult",
    "ChronomqError",
    "ConsumedLog",
    "Consumer",
    "Message",
    "MessageData",
    "Producer",
    "RequestError",
    "SendResult",
    "ServerError",
    "UnavailableError",
]
