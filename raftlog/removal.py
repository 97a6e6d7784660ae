"""A node removed from the cluster knows it, across restarts, until it is added back.

The leader removes a member from Raft first (pysyncobj drops it from its peers at once, so
the removed node never receives the entry that removes it), then tells it with a
:class:`RemovalNotice` signed with the cluster secret. The removed node checks the signature,
that the notice names its own id and Raft address, and that the removal lies past what it
has applied (an old notice replayed after it was added back is ignored); it then writes the
notice to ``<data_dir>/raft/removed.json`` and stops campaigning. The file is removed when a
leader sends it log entries again: only members are sent entries, so it has been added back.

A node started to *join* has no such file and is not removed, although it is not a member
yet either: only a recorded removal makes a node removed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from chronomq.raftlog import durable

FILE_NAME = "removed.json"
#: ``v`` of the notice's JSON. A notice without one (written before notices carried it) is
#: version 1; any other version is refused.
NOTICE_VERSION = 1
SIGNATURE_HEADER = "X-Chronomq-Signature"
_SIGN_CONTEXT = b"chronomq-removal-notice-v1"
_MAX_NOTICE_BYTES = 4096


class NoticeRefused(ValueError):
    """A removal notice that does not hold (bad signature, another node's, stale, malformed)."""


@dataclass(frozen=True, slots=True)
class RemovalNotice:
    """The leader's word that node ``node_id`` at ``raft`` was removed at Raft ``index``."""

    node_id: int
    raft: str
    index: int
    term: int
    at_ms: int
    by: int | None  # the leader that removed it

    def encode(self) -> bytes:
        return orjson.dumps({"v": NOTICE_VERSION, **asdict(self)}, option=orjson.OPT_SORT_KEYS)

    @classmethod
    def decode(cls, data: bytes) -> RemovalNotice:
        if len(data) > _MAX_NOTICE_BYTES:
            raise NoticeRefused("the notice is too large")
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise NoticeRefused(f"the notice is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise NoticeRefused("the notice must be an object")
        version = raw.get("v", NOTICE_VERSION)
        if version != NOTICE_VERSION or isinstance(version, bool):
            raise NoticeRefused(
                f"the notice has version {version!r}, this node reads {NOTICE_VERSION}"
            )
        ints = ("node_id", "index", "term", "at_ms")
        for name in ints:
            value = raw.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise NoticeRefused(f"{name} must be a non-negative integer")
        by = raw.get("by")
        if by is not None and (not isinstance(by, int) or isinstance(by, bool)):
            raise NoticeRefused("by must be an integer or null")
        if not isinstance(raw.get("raft"), str) or len(raw["raft"]) > 300:
            raise NoticeRefused("raft must be a host:port string")
        return cls(raw["node_id"], raw["raft"], raw["index"], raw["term"], raw["at_ms"], by)

    def describe(self) -> str:
        leader = "" if self.by is None else f" by leader node {self.by}"
        return f"node {self.node_id} ({self.raft}) removed{leader} at index {self.index}, term {self.term}"


def sign(secret: bytes, body: bytes) -> str:
    """The hex MAC of a notice's bytes under the cluster secret ("" without a secret)."""
    if not secret:
        return ""
    return hmac.new(secret, _SIGN_CONTEXT + body, hashlib.sha256).hexdigest()


def verify(
    secret: bytes,
    body: bytes,
    signature: str,
    *,
    node_id: int,
    raft: str,
    applied_index: int,
) -> RemovalNotice:
    """The notice in ``body`` if it is signed with ``secret`` and removes this node (``node_id``
    at ``raft``) past ``applied_index``; :class:`NoticeRefused` otherwise."""
    if secret and not hmac.compare_digest(sign(secret, body), signature):
        raise NoticeRefused("the notice is not signed with the cluster secret")
    notice = RemovalNotice.decode(body)
    if notice.node_id != node_id or notice.raft != raft:
        raise NoticeRefused(
            f"the notice removes node {notice.node_id} at {notice.raft}, not this node "
            f"({node_id} at {raft})"
        )
    if notice.index <= applied_index:
        raise NoticeRefused(
            f"the removal at index {notice.index} is not past this node's applied index "
            f"{applied_index}: it was added back since"
        )
    return notice


class RemovalFile:
    """``removed.json`` in a node's Raft directory."""

    def __init__(self, raft_dir: str | os.PathLike[str]) -> None:
        self.path = Path(raft_dir) / FILE_NAME

    def load(self) -> RemovalNotice | None:
        """The recorded removal, or None (a damaged file counts as a removal of unknown
        details: the node was told it was removed and must not campaign)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return RemovalNotice.decode(data)
        except NoticeRefused:
            return RemovalNotice(-1, "", 0, 0, 0, None)

    def save(self, notice: RemovalNotice) -> None:
        durable.write_atomically(self.path, notice.encode(), tmp=self.path.with_suffix(".tmp"))

    def clear(self) -> None:
        durable.unlink(self.path, missing_ok=True)


def as_json(notice: RemovalNotice | None) -> dict[str, Any] | None:
    return None if notice is None else asdict(notice)
