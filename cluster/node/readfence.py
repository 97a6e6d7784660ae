"""Follower reads that see every acknowledged write: the read index (Raft thesis section 6.4).

A write is acknowledged once the leader has committed and applied it; a follower applies it a
little later. A read that a follower would answer with "no such topic" or an empty page may
therefore miss a write its client already saw acknowledged. Before such an answer the follower
asks the leader for its commit index (``GET /v1/admin/read-index``, on the node-to-node channel
with the cluster's token; the leader answers only while its lease holds) and waits, at most
``follower_read_timeout_ms``, until it has applied that far; then it reads again.

Concurrent reads share one question: a read joins a question asked *after* it began (its
answer covers every write acknowledged before the read), or waits for the one in flight to
end and asks the next. Reads that find what they look for never ask.

When the leader cannot be asked (none known, unreachable, or not leading any more) or this
node does not catch up in time, the read fails with 503 rather than answer with what might be
missing: ``no_leader`` / ``read_index_unavailable`` / ``replica_behind``, each with
``Retry-After``; the client retries, on another node if it likes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from chronomq.cluster.node.errors import ApiError

#: How often a read waiting for this node to apply the leader's commit index looks again.
APPLY_POLL_S = 0.005


@dataclass(slots=True)
class _Question:
    asked_at: float
    answer: asyncio.Future[int]


class ReadFence:
    """The read index of one node (see the module). Lives on the event loop."""

    def __init__(
        self,
        ask_leader: Callable[[], Awaitable[int]],
        applied_index: Callable[[], int],
        timeout_s: float,
    ) -> None:
        """``ask_leader()``: the leader's commit index now (raises :class:`ApiError` when it
        cannot be had); ``applied_index()``: how far this node has applied."""
        self._ask_leader = ask_leader
        self._applied_index = applied_index
        self._timeout_s = timeout_s
        self._question: _Question | None = None
        self.fences = 0  # reads that asked (or joined a question)
        self.waited = 0  # of those, reads that had to wait for this node to apply

    async def wait(self) -> None:
        """Return once this node has applied every write acknowledged before the call."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + self._timeout_s
        self.fences += 1
        try:
            target = await asyncio.wait_for(self._index_after(began), self._timeout_s)
        except TimeoutError:
            raise _unavailable(
                f"no answer within {self._timeout_s * 1000:.0f} ms (follower_read_timeout_ms)"
            ) from None
        if self._applied_index() >= target:
            return
        self.waited += 1
        while self._applied_index() < target:
            if loop.time() >= deadline:
                raise ApiError(
                    503,
                    "replica_behind",
                    f"this node has applied up to index {self._applied_index()}, behind the "
                    f"leader's commit index {target}, after {self._timeout_s * 1000:.0f} ms "
                    "(follower_read_timeout_ms); retry, or read from the leader",
                    None,
                    {"Retry-After": "1"},
                )
            await asyncio.sleep(APPLY_POLL_S)

    async def _index_after(self, began: float) -> int:
        loop = asyncio.get_running_loop()
        while True:
            q = self._question
            if q is not None and q.asked_at >= began:
                return await asyncio.shield(q.answer)
            if q is not None and not q.answer.done():
                # Asked before this read began: its answer may miss this read's writes.
                with contextlib.suppress(Exception):
                    await asyncio.shield(q.answer)
                continue
            answer: asyncio.Future[int] = loop.create_future()
            self._question = _Question(loop.time(), answer)
            try:
                answer.set_result(await self._ask_leader())
            except asyncio.CancelledError:
                # This read gave up (its deadline); the reads that joined hear why.
                _fail(answer, _unavailable("the question to the leader was not answered in time"))
                raise
            except ApiError as exc:
                _fail(answer, exc)
                raise
            except Exception as exc:
                _fail(answer, _unavailable(str(exc)))
                raise _unavailable(str(exc)) from exc
            return answer.result()


def _unavailable(why: str) -> ApiError:
    return ApiError(
        503,
        "read_index_unavailable",
        f"this node could not learn the leader's commit index ({why}), so it cannot tell "
        "whether it has every acknowledged write; retry",
        None,
        {"Retry-After": "1"},
    )


def _fail(answer: asyncio.Future[int], exc: BaseException) -> None:
    if not answer.done():
        answer.set_exception(exc)
        answer.exception()  # retrieved: a failure nobody joined is not logged as lost
