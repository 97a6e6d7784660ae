"""The chronomq Python client.

``chronomq.Producer`` and ``chronomq.Consumer`` are synchronous (threads; Django, Flask,
scripts); ``chronomq.aio.Producer`` and ``chronomq.aio.Consumer`` run on asyncio. Both talk
to the nodes' HTTP API: give them every node's URL.

    import chronomq

    with chronomq.Producer(["http://127.0.0.1:8080", "http://127.0.0.1:8081"]) as producer:
        sent = producer.send("orders", "order 42 times out", delay_ms=30 * 60 * 1000)
        producer.cancel(sent.msg_id)        # paid after all
"""

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
    "Consumer",
    "Message",
    "MessageData",
    "Producer",
    "RequestError",
    "SendResult",
    "ServerError",
    "UnavailableError",
]
