"""A check of the Raft journal file before the node starts on it.

The journal's records carry a CRC (:mod:`chronomq.raftlog.journal`), so a record torn by a power cut is
told from one damaged later: a torn tail is cut when the journal opens. :func:`check_journal`
reads the file first and returns the first problem that cannot be repaired:

* its term and vote (``journal.meta``) cannot be read;
* the header is not the journal's (or pysyncobj's format 1, read strictly: it has no CRC);
* a record is bad and records written after it was synced follow it (damage, not a torn
  write: see :data:`chronomq.raftlog.journal.TORN_GROUPS`);
* entry indexes do not follow one another, or a term goes down;
* a command does not decode: an unknown command type, or for a replicated call, our codec.

A journal with such a problem cannot be repaired locally: its entries may be ones this node
acknowledged to a leader, and dropping them could lose a committed write. The node refuses to
start and says how to rebuild it from its peers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog import safepickle
from chronomq.raftlog.journal import JournalDamaged, load_meta, read_file

# pysyncobj's command types (pysyncobj.syncobj._COMMAND_TYPE).
_REGULAR, _NO_OP, _MEMBERSHIP, _VERSION = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class JournalProblem:
    offset: int
    index: int | None
    reason: str

    def describe(self, path: str) -> str:
        where = f"entry {self.index}" if self.index is not None else "its header"
        if self.index is None and self.offset:
            where = "a record"
        return f"the Raft journal {path} is damaged at byte {self.offset} ({where}): {self.reason}"


def check_journal(path: str) -> JournalProblem | None:
    """The first problem in the journal file at ``path``; None when it is sound, absent, or
    only ends in a torn record."""
    try:
        load_meta(path + ".meta")
        got = read_file(path)
    except JournalDamaged as exc:
        return JournalProblem(exc.offset, exc.index, exc.reason)
    if got is None:
        return None
    for at, (command, index, _term) in zip(got.offsets, got.entries, strict=True):
        problem = _command_problem(command)
        if problem is not None:
            return JournalProblem(at, index, problem)
    return None


def _command_problem(command: bytes) -> str | None:
    if not command:
        return "an empty command"
    kind = command[0]
    if kind == _NO_OP:
        return None
    if kind not in (_REGULAR, _MEMBERSHIP, _VERSION):
        return f"unknown command type {kind}"
    try:
        call = safepickle.loads_log(command[1:])
    except Exception as exc:
        return f"the command does not decode ({exc.__class__.__name__}: {exc})"
    if kind != _REGULAR:
        return None
    args = call[1] if isinstance(call, tuple) and len(call) >= 2 else ()
    for arg in args if isinstance(args, (list, tuple)) else ():
        if isinstance(arg, bytes):
            try:
                cmdcodec.decode(arg)
            except Exception as exc:
                return f"the command does not decode ({exc.__class__.__name__}: {exc})"
    return None


def journal_advice(path: str, data_dir: str | os.PathLike[str]) -> str:
    """What the operator should do about a damaged journal (or snapshot) of this node."""
    return (
        f"{path} cannot be repaired here (its entries may be ones this node acknowledged). "
        f"If the other nodes are serving, move this node's data directory {data_dir} aside "
        "and start the node again: it rejoins empty and copies the state from its peers. "
        "If they are not, keep the directory and restore it from a backup"
    )
