"""Errors of the replicated log.

Caller mistakes (:class:`InvalidInput` and its children) are distinct from faults of the store
or of peers (:class:`StoreCorruption`, :class:`ReplicationError`): the first become HTTP 4xx
answers, the second are ours to fix.
"""

from __future__ import annotations


class RaftLogError(Exception):
    """Base class of every error raised by :mod:`chronomq.raftlog`."""


class InvalidInput(RaftLogError, ValueError):
    """The caller sent something we will not store. ``field`` names the offending input."""

    code = "invalid_input"

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class MessageTooLarge(InvalidInput):
    code = "message_too_large"


class UnknownTopic(InvalidInput):
    code = "unknown_topic"


class UnknownQueue(InvalidInput):
    code = "unknown_queue"


class IdempotencyKeyReused(InvalidInput):
    """An idempotency key came back with a different request within its window."""

    code = "idempotency_key_reused"


class NodeFault(RaftLogError):
    """Something wrong with this node itself (its files, its settings), not with a command.

    Apply lets it (and ``OSError``) through, and the node stops rather than diverge; every
    other error a command causes at apply is a recorded rejection (:class:`ApplyRejected`).
    """


class StoreCorruption(NodeFault):
    """Bytes on disk do not decode: a torn write, a bit flip or a bug. Never the caller's fault."""


class ApplyRejected(InvalidInput):
    """A committed command (or one batch of it) breaks a rule of apply.

    Every replica rejects it the same way: nothing of the rejected part is stored, the batch's
    outcome says why (``field`` names the offending input), and the store counts it.
    """

    code = "rejected_at_apply"


class ReplicationError(RaftLogError):
    """The Raft group could not commit a command."""

    code = "replication_failed"


class NotLeader(ReplicationError):
    """This node does not lead; ``leader`` is the Raft address of the one that does, if known."""

    code = "not_leader"

    def __init__(self, message: str, leader: str | None = None) -> None:
        super().__init__(message)
        self.leader = leader


class CommitTimeout(ReplicationError):
    """The command was proposed but its outcome is unknown after the deadline."""

    code = "commit_timeout"


class CommitOutcomeUnknown(CommitTimeout):
    """The command was proposed, then leadership changed or lapsed before its outcome was
    known: it may have committed. Unlike :class:`NotLeader` (nothing was proposed), a retry
    must reuse the idempotency key."""

    code = "commit_outcome_unknown"


class Overloaded(ReplicationError):
    """Too many appends are waiting for commit; retry later."""

    code = "overloaded"


class ConditionFailed(RaftLogError):
    """A batch's ``expect`` conditions did not hold when it was applied; nothing was written."""

    code = "condition_failed"

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key
