"""The delay level table (RocketMQ 4.x ``messageDelayLevel``).

The table is the config key ``message_delay_level``: whitespace-separated delays, each a
positive integer followed by a unit (``s``, ``m``, ``h`` or ``d``). Level ``n`` (1-based) waits
the ``n``-th delay; level 0 means no delay. A message waits in ``SCHEDULE_TOPIC_XXXX``, queue
``level - 1``, and its deliver time, store time plus the level's delay, is the ConsumeQueue
entry's tagsCode (seed 001, "Broker端处理延迟消息").

Rules, RocketMQ's plus two checks it lacks:

- a level above the maximum is clamped to the maximum, and the answer says it was;
- a negative level, or one that is not an integer, is the caller's error;
- the table must be non-empty, each delay positive, no delay repeated, at most
  :data:`MAX_LEVELS` levels of at most :data:`MAX_LEVEL_DELAY_MS` each. Delays need not
  increase (RocketMQ does not require it); the highest level is the last one listed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from chronomq.schedule.errors import ConfigError, InvalidDelayLevel

CONFIG_KEY: Final = "message_delay_level"
DEFAULT_MESSAGE_DELAY_LEVEL: Final = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
SCHEDULE_TOPIC: Final = "SCHEDULE_TOPIC_XXXX"

UNIT_MS: Final[dict[str, int]] = {
    "s": 1_000,
    "m": 60_000,
    "h": 3_600_000,
    "d": 86_400_000,
}
MAX_LEVELS: Final = 256
"""Each level gets its own delivery loop, so the table is bounded."""
MAX_LEVEL_DELAY_MS: Final = 365 * UNIT_MS["d"]
"""One year; longer waits belong to the timer (and outlive CommitLog retention anyway)."""

_LEVEL_FIELD: Final = "delay_level"


@dataclass(frozen=True, slots=True)
class ResolvedLevel:
    """A requested delay level after validation and clamping."""

    requested: int
    level: int
    """The level the message will wait at: 0 (no delay) up to the table's maximum."""
    delay_ms: int
    clamped: bool
    """True when ``requested`` was above the maximum and ``level`` is the maximum."""

    @property
    def is_delayed(self) -> bool:
        return self.level > 0


@dataclass(frozen=True, slots=True)
class DelayLevelTable:
    """The delays of levels 1..max, in milliseconds. Build with :meth:`parse` or :meth:`default`."""

    delays_ms: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_delays(self.delays_ms)

    @classmethod
    def parse(cls, text: str) -> DelayLevelTable:
        """Parse ``message_delay_level``; raise :class:`ConfigError` naming the key if it is bad."""
        if not isinstance(text, str):
            raise ConfigError(CONFIG_KEY, f"must be a string, got {type(text).__name__}")
        tokens = text.split()
        if not tokens:
            raise ConfigError(CONFIG_KEY, "is empty; give at least one delay such as '1s'")
        return cls(tuple(_parse_token(i + 1, token) for i, token in enumerate(tokens)))

    @classmethod
    def default(cls) -> DelayLevelTable:
        return cls.parse(DEFAULT_MESSAGE_DELAY_LEVEL)

    @property
    def max_level(self) -> int:
        return len(self.delays_ms)

    def levels(self) -> range:
        """Levels 1..max, one delivery loop each."""
        return range(1, self.max_level + 1)

    def text(self) -> str:
        """The table in ``message_delay_level`` syntax, in the largest exact unit per level."""
        return " ".join(format_delay(delay_ms) for delay_ms in self.delays_ms)

    def resolve(self, level: object) -> ResolvedLevel:
        """Validate a requested level and clamp it to the maximum.

        Raises :class:`InvalidDelayLevel` (field ``delay_level``) for a negative level or a
        value that is not an integer (``True``, ``1.5`` and ``"3"`` included).
        """
        if isinstance(level, bool) or not isinstance(level, int):
            raise InvalidDelayLevel(
                f"delay_level must be an integer, got {level!r}", field=_LEVEL_FIELD
            )
        if level < 0:
            raise InvalidDelayLevel(
                f"delay_level must be 0 (no delay) or a positive level, got {level}",
                field=_LEVEL_FIELD,
            )
        if level == 0:
            return ResolvedLevel(requested=0, level=0, delay_ms=0, clamped=False)
        clamped = level > self.max_level
        effective = self.max_level if clamped else level
        return ResolvedLevel(
            requested=level,
            level=effective,
            delay_ms=self.delays_ms[effective - 1],
            clamped=clamped,
        )

    def delay_ms(self, level: int) -> int:
        """The delay of an existing level (1..max); 0 for level 0."""
        if level == 0:
            return 0
        self._check_existing(level)
        return self.delays_ms[level - 1]

    def deliver_ms(self, store_ms: int, level: int) -> int:
        """Deliver time of a message stored at ``store_ms`` with the requested ``level``.

        The level is resolved first (clamped if above the maximum).
        """
        return store_ms + self.resolve(level).delay_ms

    def queue_id(self, level: int) -> int:
        """Queue id in the schedule topic for an existing level: ``level - 1``."""
        self._check_existing(level)
        return level - 1

    def level_of_queue(self, queue_id: int) -> int:
        """The level a schedule-topic queue id belongs to: ``queue_id + 1``."""
        if isinstance(queue_id, bool) or not isinstance(queue_id, int):
            raise InvalidDelayLevel(f"queue id must be an integer, got {queue_id!r}", field="queue")
        if not 0 <= queue_id < self.max_level:
            raise InvalidDelayLevel(
                f"{SCHEDULE_TOPIC} has queues 0..{self.max_level - 1}, got {queue_id}",
                field="queue",
            )
        return queue_id + 1

    def _check_existing(self, level: int) -> None:
        if isinstance(level, bool) or not isinstance(level, int):
            raise InvalidDelayLevel(
                f"delay_level must be an integer, got {level!r}", field=_LEVEL_FIELD
            )
        if not 1 <= level <= self.max_level:
            raise InvalidDelayLevel(
                f"delay_level must be in 1..{self.max_level}, got {level}", field=_LEVEL_FIELD
            )


def is_schedule_topic(topic: str) -> bool:
    return topic == SCHEDULE_TOPIC


def format_delay(delay_ms: int) -> str:
    """``3_600_000`` -> ``"1h"``, ``90_000`` -> ``"90s"``; delays are whole seconds."""
    for unit in ("d", "h", "m"):
        if delay_ms % UNIT_MS[unit] == 0:
            return f"{delay_ms // UNIT_MS[unit]}{unit}"
    if delay_ms % UNIT_MS["s"] != 0:
        raise ValueError(f"delay {delay_ms} ms is not a whole number of seconds")
    return f"{delay_ms // UNIT_MS['s']}s"


def _parse_token(position: int, token: str) -> int:
    where = f"level {position} ({token!r})"
    number, unit = token[:-1], token[-1]
    if unit.isdigit():
        raise ConfigError(CONFIG_KEY, f"{where} has no unit; end it with s, m, h or d")
    if unit not in UNIT_MS:
        raise ConfigError(
            CONFIG_KEY, f"{where} has unknown unit {unit!r}; use one of s, m, h, d (e.g. '10s')"
        )
    if not number.isascii() or not number.isdigit():
        raise ConfigError(CONFIG_KEY, f"{where} must be a whole number followed by s, m, h or d")
    return int(number) * UNIT_MS[unit]


def _check_delays(delays_ms: tuple[int, ...]) -> None:
    if not delays_ms:
        raise ConfigError(CONFIG_KEY, "is empty; give at least one delay such as '1s'")
    if len(delays_ms) > MAX_LEVELS:
        raise ConfigError(CONFIG_KEY, f"has {len(delays_ms)} levels; at most {MAX_LEVELS}")
    first_level_of: dict[int, int] = {}
    for level, delay_ms in enumerate(delays_ms, start=1):
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, int):
            raise ConfigError(CONFIG_KEY, f"level {level} delay must be an integer of ms")
        if delay_ms <= 0:
            raise ConfigError(CONFIG_KEY, f"level {level} has a non-positive delay; use 1s or more")
        if delay_ms % UNIT_MS["s"] != 0:
            raise ConfigError(CONFIG_KEY, f"level {level} delay must be whole seconds")
        if delay_ms > MAX_LEVEL_DELAY_MS:
            raise ConfigError(
                CONFIG_KEY, f"level {level} delay {format_delay(delay_ms)} is longer than 365d"
            )
        if delay_ms in first_level_of:
            raise ConfigError(
                CONFIG_KEY,
                f"level {level} repeats the delay of level {first_level_of[delay_ms]} "
                f"({format_delay(delay_ms)}); each level needs its own delay",
            )
        first_level_of[delay_ms] = level
