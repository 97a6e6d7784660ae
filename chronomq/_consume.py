"""The consumer's bookkeeping, without I/O: which queues to read from where, what the
application has finished, what to commit and when; and, per queue, where the next pull starts
and what was read there lately (:class:`QueueCursor`). Times are monotonic seconds passed in.

A message counts as finished when the application asks for the next one, commits, sends it
back with ``reconsume_later()``, or closes the consumer without an exception. Offsets are
committed only up to finished messages, so a crash in the middle of one hands it out again
(at-least-once), and a commit never moves an offset backwards but after a rewind.

A rewind: when every node loses power under ``flush = async`` the log may lose its newest
entries, and the offsets they held are written again by new messages. A fetcher past them
would skip those; instead each pull names the msg_id read at ``offset - 1`` (``prev``), a node
that holds another message there answers 409 ``offset_diverged``, and the cursor finds the
first offset whose message changed and reads again from there (:class:`Rewind`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from chronomq import _api
from chronomq._model import MessageData, retry_topic
from chronomq.errors import ApiError

QueueKey = tuple[str, int]
Start = Literal["earliest", "latest"]

REMEMBERED_OFFSETS = 4096
"""How many of its latest (offset, msg_id) a fetcher keeps per queue to find where a rewound
log diverged from what it read."""
SEARCH_WAIT_MS = 1000
"""Longest long-poll of a read that looks for the divergence (what it reads exists)."""
REFRESH_RETRY_S = 1.0
"""Pause before looking at the topics again after the cluster did not answer."""
MAX_EMPTY_SEARCH_READS = 5
"""Empty answers in a row after which a search stops where it is (reading again from there
hands out messages twice at worst; it never skips one)."""


@dataclass(frozen=True, slots=True)
class FetchStart:
    """Start reading ``topic``/``queue`` at ``offset``."""

    topic: str
    queue: int
    offset: int


@dataclass(frozen=True, slots=True)
class Rewind:
    """The log of ``topic``/``queue`` was rewound under a fetcher at ``old_offset``; it reads
    again from ``offset``, the first offset whose message changed (or that the log lacks).

    ``epoch`` counts the queue's rewinds: messages fetched before this one have a lower
    epoch, and those from ``offset`` on are not handed out. ``missed_before`` is set when even
    the oldest offset remembered changed while the log holds older ones: messages written
    again before it cannot have been seen."""

    topic: str
    queue: int
    old_offset: int
    offset: int
    epoch: int
    missed_before: int | None = None

    def describe(self) -> str:
        """The warning to log, once per rewind."""
        text = (
            f"{self.topic}/{self.queue}: the log lost its newest entries (every node lost "
            f"power under flush = async) and their offsets were written again: reading again "
            f"from offset {self.offset} instead of {self.old_offset}"
        )
        if self.missed_before is not None:
            text += (
                f"; messages before offset {self.missed_before} may have been missed (even the "
                "oldest offset remembered holds another message now)"
            )
        return text


class ConsumerState:
    def __init__(
        self,
        group: str,
        topics: Sequence[str],
        *,
        start: Start,
        auto_commit_interval_s: float | None,
        refresh_interval_s: float,
        now: float,
    ) -> None:
        if not group:
            raise ValueError("a consumer needs a group")
        if not topics:
            raise ValueError("a consumer needs at least one topic")
        if start not in ("earliest", "latest"):
            raise ValueError(f"start must be 'earliest' or 'latest', not {start!r}")
        self.group = group
        self.retry_topic = retry_topic(group)
        self.topics = [*dict.fromkeys(topics)]
        if self.retry_topic not in self.topics:
            self.topics.append(self.retry_topic)
        self.start = start
        self.auto_commit_interval_s = auto_commit_interval_s
        self.refresh_interval_s = refresh_interval_s
        self.fetching: dict[QueueKey, int] = {}
        """Queues being read, with the offset reading started at (or resumed at after a
        rewind, when lower)."""
        self._seen: set[str] = set()
        """Topics described at least once (existing or not)."""
        self.done: dict[QueueKey, int] = {}
        self.committed: dict[QueueKey, int] = {}
        self.in_hand: MessageData | None = None
        self._in_hand_epoch = 0
        self._rewinds: deque[Rewind] = deque()
        """Rewinds fetchers reported (threads may append), applied on the consumer's thread."""
        self._resumes: dict[QueueKey, list[int]] = {}
        """Per queue, where reading resumed after each rewind: item ``e`` ends epoch ``e``
        (one per rewind, and a rewind takes every node losing power)."""
        self._recommit: set[QueueKey] = set()
        """Queues whose committed offset on the broker was rewound with the log: the next
        commit sends what is finished even if it is below what was committed before."""
        self.next_refresh = now
        self.next_commit = now + (auto_commit_interval_s or 0.0)

    # ------------------------------------------------------------------ which queues

    def plan(
        self,
        topic: str,
        described: Mapping[str, Any] | None,
        offsets: Iterable[Mapping[str, Any]],
    ) -> list[FetchStart]:
        """Queues of ``topic`` to start reading, from ``GET /v1/topics/{topic}`` (None: no
        such topic yet) and the group's committed offsets for it.

        A queue resumes at the committed offset; without one, at the start the consumer was
        given, except in a topic or queue that appeared while the consumer ran (the retry
        topic, a topic created later, queues added), which is read from its first message."""
        first_look = topic not in self._seen
        self._seen.add(topic)
        if described is None:
            return []
        committed = {
            int(o["queue"]): int(o["offset"]) for o in offsets if o.get("topic", topic) == topic
        }
        out: list[FetchStart] = []
        for q in described.get("queues", ()):
            queue = int(q["queue"])
            key = (topic, queue)
            if key in self.fetching:
                continue
            if queue in committed:
                offset = committed[queue]
                self.committed[key] = offset
            elif first_look and self.start == "latest" and topic != self.retry_topic:
                offset = int(q["max_offset"])
            else:
                offset = int(q["min_offset"])
            self.fetching[key] = offset
            self.done.setdefault(key, offset)
            out.append(FetchStart(topic, queue, offset))
        return out

    def refresh_due(self, now: float) -> bool:
        return now >= self.next_refresh

    def refreshed(self, now: float) -> None:
        self.next_refresh = now + self.refresh_interval_s

    def refresh_failed(self, now: float) -> None:
        """No node answered (or all answered 5xx) while looking at the topics: try again in
        :data:`REFRESH_RETRY_S`; fetchers already started go on on their own."""
        self.next_refresh = now + REFRESH_RETRY_S

    def refresh_soon(self, now: float, within_s: float = 0.5) -> None:
        """Look for new queues soon (a send-back may just have created the retry topic)."""
        self.next_refresh = min(self.next_refresh, now + within_s)

    # ------------------------------------------------------------------ progress

    def hand_out(self, message: MessageData, epoch: int = 0) -> bool:
        """``message``, fetched in ``epoch``, goes to the application; the one it had before
        is finished. False (and it does not) when a rewind since put it past the resume
        point: the log holds another message at its offset now, fetched again."""
        self.finish_in_hand()
        if self._stale(message, epoch):
            return False
        self.in_hand = message
        self._in_hand_epoch = epoch
        return True

    def finish(self, message: MessageData, epoch: int = 0) -> None:
        """``message``, fetched in ``epoch``, is finished: offsets up to it may be committed,
        unless a rewind since put it past the resume point."""
        self._apply_rewinds()
        key = (message.topic, message.queue)
        if not self._stale(message, epoch) and message.offset + 1 > self.done.get(key, 0):
            self.done[key] = message.offset + 1
        if self.in_hand is message:
            self.in_hand = None

    def finish_in_hand(self) -> None:
        if self.in_hand is not None:
            self.finish(self.in_hand, self._in_hand_epoch)

    def to_commit(self) -> dict[QueueKey, int]:
        """Offsets finished past what was committed (or below it, after a rewind)."""
        self._apply_rewinds()
        return {
            k: v
            for k, v in self.done.items()
            if k in self._recommit or v > self.committed.get(k, self.fetching.get(k, -1))
        }

    def commit_done(self, key: QueueKey, offset: int) -> None:
        self._apply_rewinds()
        if offset > self.done.get(key, offset):
            return  # asked for before a rewind moved the queue back: commit again
        if key in self._recommit or offset > self.committed.get(key, -1):
            self.committed[key] = offset
            self._recommit.discard(key)

    # ------------------------------------------------------------------ rewinds

    def rewound(self, rewind: Rewind) -> None:
        """A fetcher found its queue's log rewound. Fetcher threads may call this; it takes
        effect on the consumer's thread, before the next message is handed out: reading,
        finished and committed offsets move back to ``rewind.offset``, and messages fetched
        earlier from there on are dropped (those already handed out stay handed out)."""
        self._rewinds.append(rewind)

    def _apply_rewinds(self) -> None:
        while self._rewinds:
            r = self._rewinds.popleft()
            key = (r.topic, r.queue)
            self._resumes.setdefault(key, []).append(r.offset)
            for offsets in (self.fetching, self.done, self.committed):
                if key in offsets:
                    offsets[key] = min(offsets[key], r.offset)
            # The group's committed offset was rewound with the log (commits are replicated):
            # the broker may hold less than was committed, so commit what is finished again.
            self._recommit.add(key)

    def _stale(self, message: MessageData, epoch: int) -> bool:
        """Fetched in ``epoch`` at or past where reading resumed after a later rewind."""
        later = self._resumes.get((message.topic, message.queue), [])[epoch:]
        return bool(later) and message.offset >= min(later)

    def commit_due(self, now: float) -> bool:
        return self.auto_commit_interval_s is not None and now >= self.next_commit

    def auto_committed(self, now: float) -> None:
        if self.auto_commit_interval_s is not None:
            self.next_commit = now + self.auto_commit_interval_s

    def wait_s(self, now: float, cap_s: float) -> float:
        """How long the application may wait for a message before there is work to do."""
        until = self.next_refresh
        if self.auto_commit_interval_s is not None:
            until = min(until, self.next_commit)
        return max(0.0, min(cap_s, until - now))


# ---------------------------------------------------------------------- reading one queue


@dataclass(frozen=True, slots=True)
class Pulled:
    """What one answer to a :class:`QueueCursor` request gives its fetcher: ``messages`` (the
    answer's JSON objects) to hand out, fetched in ``epoch``, and the rewind a search for the
    divergence ended with (to log once and report to :meth:`ConsumerState.rewound`)."""

    messages: Sequence[Mapping[str, Any]]
    epoch: int
    rewind: Rewind | None = None


class _Search:
    """Where a rewound log diverged from what was read: it is read again from ``start`` and
    compared offset by offset with ``remembered`` up to ``end`` (the old position, or the
    queue's end when that is lower). ``resume`` is set once found: the first offset whose
    msg_id differs or that the log lacks, or ``end``."""

    def __init__(self, remembered: Mapping[int, str], start: int, end: int) -> None:
        self._remembered = remembered
        self.start = start
        self.at = start
        self.end = end
        self.resume: int | None = end if start >= end else None
        self._empty_reads = 0

    def read(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """A page read from :attr:`at` (without ``prev``)."""
        if self.resume is not None:
            return
        if not messages:
            # The node has not applied these offsets yet, or the log shrank again.
            self._empty_reads += 1
            if self._empty_reads >= MAX_EMPTY_SEARCH_READS:
                self.resume = self.at
            return
        self._empty_reads = 0
        for m in messages:
            offset = int(m["offset"])
            if offset < self.at:
                continue
            if offset > self.at or self._remembered.get(offset) != str(m["msg_id"]):
                self.resume = self.at  # gone (the page starts later), or another message
                return
            self.at += 1
            if self.at >= self.end:
                self.resume = self.end
                return


class QueueCursor:
    """Where a fetcher reads one queue next, and the msg_ids it read there lately (the last
    ``remember`` offsets).

    The fetcher sends :meth:`request` and gives the answer to :meth:`answered`, or a 4xx
    error to :meth:`refused`. Every pull after the first message sends ``prev``, the msg_id
    read at ``offset - 1``; a 409 ``offset_diverged`` (the log lost its newest entries and
    their offsets were written again) starts a search: the queue is read again, without
    ``prev``, from the oldest offset remembered (or the queue's minimum, if higher) up to the
    old position, and reading resumes at the first offset whose msg_id differs or that the log
    no longer has.
    """

    def __init__(
        self,
        start: FetchStart,
        max_messages: int,
        wait_ms: int,
        remember: int = REMEMBERED_OFFSETS,
    ) -> None:
        if remember < 1:
            raise ValueError(f"remember must be at least 1, not {remember}")
        self.topic = start.topic
        self.queue = start.queue
        self.offset = start.offset
        """Where the next pull starts."""
        self.epoch = 0
        """How many rewinds this queue had."""
        self._max_messages = max_messages
        self._wait_ms = wait_ms
        self._remember = remember
        self._ids: OrderedDict[int, str] = OrderedDict()
        """offset -> msg_id of the latest messages read, in offset order."""
        self._search: _Search | None = None
        self._min_offset = 0

    def prev(self) -> str | None:
        """The msg_id read at ``offset - 1``, sent with the next pull (None before the first
        message, or when it was not read: a retention gap, or the start of a rewind)."""
        return self._ids.get(self.offset - 1)

    def remembered(self) -> dict[int, str]:
        """offset -> msg_id of what is remembered, oldest first."""
        return dict(self._ids)

    def request(self) -> _api.Req:
        """The next pull: reading on, or a read of the search for a divergence."""
        s = self._search
        if s is None:
            return _api.pull(
                self.topic, self.queue, self.offset, self._max_messages, self._wait_ms, self.prev()
            )
        count = max(1, min(self._max_messages, s.end - s.at))
        return _api.pull(self.topic, self.queue, s.at, count, min(self._wait_ms, SEARCH_WAIT_MS))

    def answered(self, answer: Mapping[str, Any]) -> Pulled:
        """The answer to :meth:`request`."""
        messages: Sequence[Mapping[str, Any]] = answer["messages"]
        s = self._search
        if s is None:
            for m in messages:
                self._note(int(m["offset"]), str(m["msg_id"]))
            self.offset = int(answer["next_offset"])
            return Pulled(messages, self.epoch)
        s.read(messages)
        return self._searched(s)

    def refused(self, error: ApiError) -> Pulled | None:
        """A 4xx answer to :meth:`request`: None unless it says the log diverged under the
        pull's ``prev`` (409 ``offset_diverged``); then the search for where starts, and the
        next :meth:`request` is its first read."""
        if (
            error.status != 409
            or error.code != "offset_diverged"
            or self._search is not None
            or self.prev() is None
        ):
            return None
        body = error.body if isinstance(error.body, dict) else {}
        self._min_offset = _int(body.get("min_offset"), 0)
        # The node's queue ends at max_offset: nothing from there on is what was read.
        end = min(self.offset, _int(body.get("max_offset"), self.offset))
        start = max(next(iter(self._ids)), self._min_offset)
        self._search = _Search(self._ids, start, end)
        return self._searched(self._search)

    def _searched(self, s: _Search) -> Pulled:
        if s.resume is None:
            return Pulled((), self.epoch)
        self._search = None
        old, resume = self.offset, s.resume
        if resume >= old:
            return Pulled((), self.epoch)  # nothing differs up to the old position: read on
        while self._ids and next(reversed(self._ids)) >= resume:
            self._ids.popitem()
        self.offset = resume
        self.epoch += 1
        missed = resume if s.start >= resume > self._min_offset else None
        return Pulled(
            (), self.epoch, Rewind(self.topic, self.queue, old, resume, self.epoch, missed)
        )

    def _note(self, offset: int, msg_id: str) -> None:
        self._ids[offset] = msg_id
        if len(self._ids) > self._remember:
            self._ids.popitem(last=False)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default
