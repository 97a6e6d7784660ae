"""Process logging: JSON lines when not on a terminal (or when asked), each naming the node."""

from __future__ import annotations

import logging
import sys
import time

import orjson


class JsonFormatter(logging.Formatter):
    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "node": self.node,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out).decode()


def setup(node: str, level: str = "info", fmt: str = "auto") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    handler = logging.StreamHandler(sys.stderr)
    if use_json:
        handler.setFormatter(JsonFormatter(node))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {node} %(levelname)s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)


#: The loggers of our own packages: they follow the root level, also when a library or a test
#: has given one of them a level of its own.
OUR_LOGGERS = ("chronomq", "cluster", "raftlog", "schedule", "timer", "ops")


def set_level(level: str) -> None:
    """Make ``level`` (debug, info, warning, error) the least severe level written, now: the
    root logger and ours; pysyncobj stays at error or above (it logs every reconnect attempt
    at warning)."""
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"unknown log level {level!r}")
    logging.getLogger().setLevel(number)
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(number)
    logging.getLogger("pysyncobj").setLevel(max(logging.ERROR, number))
