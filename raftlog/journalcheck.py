"""A check of pysyncobj's Raft journal file before the node starts on it.

pysyncobj's ``FileJournal`` trusts its file: a record whose length field is damaged makes its
loader fail with a bare ``struct.error`` (or read garbage as entries), and a damaged command is
only met when it is applied, where pysyncobj logs the exception and retries on every tick: the
node stays up, applies nothing and never says which file is at fault.

:func:`check_journal` reads the file the way ``FileJournal`` does and checks what a healthy
journal always satisfies, returning the first problem found:

* the header names pysyncobj's journal format 1 and its end offset lies inside the file;
* every record's two length fields (before and after it) agree and it ends by that offset;
* entry indexes follow one another and terms never go down;
* every command decodes: a known command type, and for a replicated call, our command codec.

A journal with a problem cannot be repaired locally: its entries may be ones this node
acknowledged to a leader, and dropping them could lose a committed write. The node refuses to
start and says how to rebuild it from its peers.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from pysyncobj.journal import FIRST_RECORD_OFFSET, JOURNAL_FORMAT_VERSION, LAST_RECORD_OFFSET_OFFSET

from chronomq.raftlog import command as cmdcodec
from chronomq.raftlog import safepickle

_LEN = struct.Struct("<I")
_ENTRY_HEAD = struct.Struct("<QQ")
_FORMAT_OFFSET = LAST_RECORD_OFFSET_OFFSET - 4
# pysyncobj's command types (pysyncobj.syncobj._COMMAND_TYPE).
_REGULAR, _NO_OP, _MEMBERSHIP, _VERSION = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class JournalProblem:
    offset: int
    index: int | None
    reason: str

    def describe(self, path: str) -> str:
        where = f"entry {self.index}" if self.index is not None else "its header"
        return f"the Raft journal {path} is damaged at byte {self.offset} ({where}): {self.reason}"


def check_journal(path: str) -> JournalProblem | None:
    """The first problem in the journal file at ``path``; None when it is sound or absent."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if len(data) < FIRST_RECORD_OFFSET:
        return JournalProblem(0, None, f"{len(data)} bytes, shorter than the header")
    (fmt,) = _LEN.unpack_from(data, _FORMAT_OFFSET)
    (end,) = _LEN.unpack_from(data, LAST_RECORD_OFFSET_OFFSET)
    if fmt != JOURNAL_FORMAT_VERSION:
        return JournalProblem(_FORMAT_OFFSET, None, f"format {fmt}, expected 1")
    if not FIRST_RECORD_OFFSET <= end <= len(data):
        return JournalProblem(
            LAST_RECORD_OFFSET_OFFSET, None, f"its end offset {end} lies outside the file"
        )
    at = FIRST_RECORD_OFFSET
    last: tuple[int, int] | None = None
    while at < end:
        if at + 4 + _ENTRY_HEAD.size + 4 > end:
            return JournalProblem(at, None, "a record runs past the journal's end")
        (size,) = _LEN.unpack_from(data, at)
        if size < _ENTRY_HEAD.size or at + size + 8 > end:
            return JournalProblem(at, None, f"a record length of {size} runs past the end")
        (trailer,) = _LEN.unpack_from(data, at + 4 + size)
        if trailer != size:
            return JournalProblem(at, None, f"record lengths {size} and {trailer} differ")
        idx, term = _ENTRY_HEAD.unpack_from(data, at + 4)
        if last is not None and (idx != last[0] + 1 or term < last[1]):
            return JournalProblem(
                at, idx, f"entry {idx} term {term} follows entry {last[0]} term {last[1]}"
            )
        problem = _command_problem(data[at + 4 + _ENTRY_HEAD.size : at + 4 + size])
        if problem is not None:
            return JournalProblem(at, idx, problem)
        last = (idx, term)
        at += size + 8
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
