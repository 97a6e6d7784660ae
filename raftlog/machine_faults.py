"""How the Raft machine stops on a fault of this node's own storage, and what it says.

A fault that only this node's files or settings can cause (EIO, ENOSPC, a damaged journal or
snapshot) stops the node with :data:`~chronomq.raftlog.durable.EXIT_STORE_FAULT`, naming the
file and what to do; the other nodes keep serving. Nothing else may stop apply (apply is total).
"""

from __future__ import annotations

import errno
import logging
import os

from chronomq.raftlog.durable import EXIT_STORE_FAULT

log = logging.getLogger("chronomq.raftlog.machine")


def fatal(message: str) -> None:
    """Apply or the journal hit a fault of this node's own files: log it and exit at once."""
    log.critical("%s: exiting so the node restarts from its files", message)
    logging.shutdown()
    os._exit(EXIT_STORE_FAULT)


def refuse(message: str) -> None:
    """This node's own files cannot be started from: say which and what to do, and exit."""
    log.critical("refusing to start: %s", message)
    logging.shutdown()
    os._exit(EXIT_STORE_FAULT)


def fault_message(exc: BaseException, data_dir: str | os.PathLike[str]) -> str:
    """What stopped apply on this node, naming the file when known, and what to do."""
    if isinstance(exc, OSError):
        return storage_fault(exc, data_dir)
    return (
        f"apply failed: {exc}. This node's files under {data_dir} are damaged or its settings "
        "differ from the cluster's: fix the setting named above, or stop the node, move the "
        "data directory aside and restart it to copy everything from its peers"
    )


def storage_fault(exc: OSError, data_dir: object) -> str:
    """What the operator reads when apply hits a local storage fault."""
    where = exc.filename or data_dir
    if exc.errno == errno.ENOSPC:
        return (
            f"no space left on device writing {where}: this node stops; the other nodes "
            f"keep serving. Free space on the disk of {data_dir} (or lower "
            "file_reserved_time_h, or grow the disk), then start this node again: it "
            "catches up from the leader"
        )
    return (
        f"storage fault writing {where} ({exc.strerror or exc}): this node stops; the other "
        f"nodes keep serving. Check the disk of {data_dir}, then start this node again"
    )
