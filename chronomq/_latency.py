"""The consumer's side of ``chronomq report``: ``consumed`` latency lines of what it handed to
the application, next to the nodes' ``stored`` and ``delivered`` lines."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chronomq.cluster.logs.schema import RecordType, consumed_line
from chronomq.cluster.logs.writer import LogWriter, LogWriterConfig

if TYPE_CHECKING:
    from chronomq._model import MessageData
    from chronomq.cluster.logs.writer import WriterStats

_log_names = itertools.count()


class ConsumedLog:
    """``consumed`` latency lines of what this process consumed, for ``chronomq report``.

    Written by a background :class:`chronomq.cluster.logs.writer.LogWriter` to
    ``<directory>/<name>/`` (``name`` defaults to ``client-<pid>-<n>``, unique in the process);
    give the report this directory next to the nodes' ones. :meth:`consumed` never blocks;
    :meth:`close` drains. The consumers write one when given ``latency_log_dir``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        name: str | None = None,
        *,
        sample_rate: float = 1.0,
    ) -> None:
        self.name = name or f"client-{os.getpid()}-{next(_log_names)}"
        self.directory = Path(directory).absolute()
        self.writer: LogWriter = LogWriter(
            self.directory, self.name, LogWriterConfig(sample_rate=sample_rate)
        ).start()

    def consumed(
        self, topic: str, messages: Sequence[Mapping[str, Any]], consumed_ms: int | None = None
    ) -> None:
        """Messages (as a pull answers them) read from ``topic`` and handed to the application
        at ``consumed_ms`` (now when None)."""
        if not messages:
            return
        at_ms = time.time_ns() // 1_000_000 if consumed_ms is None else consumed_ms
        name = self.name
        self.writer.write_rows(
            RecordType.LATENCY,
            messages,
            lambda m: consumed_line(m, topic, at_ms, name),
            lambda m: str(m["msg_id"]),
        )

    def handed_out(self, message: MessageData) -> None:
        """One message a consumer handed to the application now."""
        fields = {"msg_id": message.msg_id, "store_ms": message.store_ms}
        self.consumed(message.topic, [{**fields, "properties": message.properties}])

    def close(self) -> WriterStats:
        return self.writer.close()


def open_log(directory: str | os.PathLike[str] | None, name: str | None) -> ConsumedLog | None:
    """A consumer's log: None without a directory."""
    return ConsumedLog(directory, name) if directory is not None else None
