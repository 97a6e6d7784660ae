"""The offset-based pull RPCs (``PullMessage``, ``UpdateOffset``, ``GetOffset``,
``QueryOffset``), mapped to our consumer-group offsets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from rocketmq.grpc_protocol import service_pb2 as spb

from cluster.errors import ApiError
from cluster.rocketmq import codes
from cluster.rocketmq.rpc import ServicerBase, make_status, rpc


def _not_implemented(rpc_name: str) -> ApiError:
    return ApiError(
        501,
        "not_implemented",
        f"{rpc_name} is not implemented yet; consume with pop (ReceiveMessage) or the HTTP API",
    )


class OffsetRpcs(ServicerBase):
    """The offset RPCs of the servicer."""

    @rpc(spb.UpdateOffsetResponse)
    async def UpdateOffset(self, request: Any, context: Any) -> Any:
        raise _not_implemented("UpdateOffset")

    @rpc(spb.GetOffsetResponse)
    async def GetOffset(self, request: Any, context: Any) -> Any:
        raise _not_implemented("GetOffset")

    @rpc(spb.QueryOffsetResponse)
    async def QueryOffset(self, request: Any, context: Any) -> Any:
        raise _not_implemented("QueryOffset")

    async def PullMessage(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.metrics.observe("PullMessage", "NOT_IMPLEMENTED", 0.0)
        failure = codes.from_api_error(_not_implemented("PullMessage"))
        yield spb.PullMessageResponse(status=make_status(failure))
