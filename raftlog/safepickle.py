"""Unpickling that cannot run code: the only ``pickle.loads`` data from the network reaches.

pysyncobj pickles its messages and the commands it keeps in the Raft log. An unpickler that
resolves any global a pickle names runs whatever a ``__reduce__`` asks for (``os.system``...).
:class:`RestrictedUnpickler` resolves only the names in its allowlist and raises
:class:`ForbiddenGlobal` for every other one, so containers, strings, numbers and bytes load
as usual and nothing else does.

Two allowlists, checked against what pysyncobj 0.3.17 really pickles:

* :data:`WIRE_GLOBALS` (frames of :mod:`chronomq.raftlog.wire`, pickled at protocol 5): none. Raft
  messages are dicts, lists and tuples of str, int, bool, None and bytes, which protocol 5
  writes without naming any global.
* :data:`LOG_GLOBALS` (pysyncobj's own protocol-2 pickles: commands in the log, the
  'transmission' of one large entry, the journal's meta file): protocol 2 has no bytes opcode
  and writes ``bytes`` as ``_codecs.encode(text, 'latin1')`` (and ``b''`` as ``bytes()``);
  membership commands carry a ``pysyncobj.node.TCPNode`` (``NEWOBJ`` + ``BUILD``: its
  ``__init__`` does not run, its ``__dict__`` is filled). Each name maps to a narrow stand-in
  that accepts exactly those arguments, not to the general function.

:data:`PYSYNCOBJ_PICKLE` stands in for the ``pysyncobj.pickle`` module inside pysyncobj
(see :func:`chronomq.raftlog.wire.install` for where it is put): same dumps, restricted loads, and no
fallback to the pure-Python unpickler that ``pysyncobj.pickle.loads`` retries with.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import IO, Any

import pysyncobj.pickle as _pso_pickle
from pysyncobj.node import TCPNode


class ForbiddenGlobal(pickle.UnpicklingError):
    """A pickle named a global outside the allowlist (a peer fault, or an attack)."""


def _latin1_bytes(text: object, encoding: object = "latin1") -> bytes:
    """``_codecs.encode`` as protocol 2 uses it for bytes, and nothing else."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise ForbiddenGlobal("_codecs.encode is allowed only as (str, 'latin1')")
    return text.encode("latin1")


def _empty_bytes() -> bytes:
    """``bytes()`` as protocol 2 writes ``b''``: no argument (``bytes(10**12)`` would allocate)."""
    return b""


Allowlist = Mapping[tuple[str, str], Callable[..., Any] | type]

WIRE_GLOBALS: Allowlist = {}

LOG_GLOBALS: Allowlist = {
    ("_codecs", "encode"): _latin1_bytes,
    ("__builtin__", "bytes"): _empty_bytes,
    ("builtins", "bytes"): _empty_bytes,
    ("pysyncobj.node", "TCPNode"): TCPNode,
}


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals of its allowlist."""

    def __init__(self, file: IO[bytes], allowed: Allowlist) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise ForbiddenGlobal(f"global {module}.{name} is not allowed")
        return found


def loads(data: bytes | bytearray | memoryview, allowed: Allowlist = WIRE_GLOBALS) -> Any:
    return RestrictedUnpickler(io.BytesIO(data), allowed).load()


def loads_log(data: bytes | str) -> Any:
    """What pysyncobj's ``pickle.loads`` becomes: its log commands, restricted."""
    return loads(_pso_pickle.to_bytes(data), LOG_GLOBALS)


def load_log(file: IO[bytes]) -> Any:
    """What pysyncobj's ``pickle.load`` becomes."""
    return RestrictedUnpickler(file, LOG_GLOBALS).load()


class _PysyncobjPickle:
    """The names pysyncobj uses from its ``pysyncobj.pickle`` module, loads restricted."""

    dumps = staticmethod(_pso_pickle.dumps)
    dump = staticmethod(_pso_pickle.dump)
    to_bytes = staticmethod(_pso_pickle.to_bytes)
    loads = staticmethod(loads_log)
    load = staticmethod(load_log)


PYSYNCOBJ_PICKLE = _PysyncobjPickle
