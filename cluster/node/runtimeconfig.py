"""Runtime config: the keys marked runtime are replicated state, the same on every node.

A node's *effective* config is its file config (defaults, TOML, environment) overlaid with the
values the cluster has replicated. Each runtime key is declared once in :data:`REPLICATED`
with the kv entry that carries it:

==================================  =====================  ==================================
config key                          kv entry               value
==================================  =====================  ==================================
``log_level``                       ``cfg/log_level``      the level, a string
``ops_log_enabled``                 ``cfg/ops_log_enabled``  ``1`` / ``0``
``ops_log_sample_rate``             ``cfg/ops_log_sample_rate``  ``repr`` of the float
``enable_schedule_async_deliver``   ``sched/mode``         ``"async"`` / ``"sync"``: *is* the
                                                           schedule's replicated mode
``timer_stop_enqueue``              ``timer/sw/enqueue``   ``1`` / ``0``: *is* the timer's
``timer_stop_dequeue``              ``timer/sw/dequeue``   replicated switches
==================================  =====================  ==================================

An absent entry means "the node's file value". ``cfg/`` entries and ``sched/mode`` are written
by one kv update (:attr:`Plan.kv`); the timer's switches only by the timer's own command
(:attr:`Plan.timer`), which keeps its state mirror in step. Apply stores any scalar under any
key, so it stays total; reading is total too: an entry that does not decode to a value the
key accepts is ignored (and reported by :func:`read_overrides`). No client path writes kv
under ``cfg/``: produce writes none, group offsets live under ``go/``, members under
``member/``.

:class:`RuntimeConfig` drives it on a node: an apply listener (Raft thread) notices that one
of these entries changed and hands off to the node's loop, which recomputes the effective
config, logs each change, sets the log level and runs the config hooks (ops logs). It also
does so at start, so a restarted node takes the cluster's values, not its file's.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from chronomq.cluster.config.keys import KEY_BY_NAME, KEYS
from chronomq.cluster.config.nodeconfig import ConfigError, NodeConfig, current_name, parse_value
from chronomq.cluster.node.errors import ApiError, bad_request
from chronomq.schedule.state import ASYNC, MODE_KEY, SYNC
from chronomq.timer.state import STOP_DEQUEUE, STOP_ENQUEUE

if TYPE_CHECKING:
    from chronomq.cluster.node.broker import Broker
    from chronomq.raftlog.store import ApplyResult

log = logging.getLogger(__name__)

PREFIX: Final = "cfg/"
"""kv prefix of the runtime keys that no service owns."""

POLL_S: Final = 1.0
"""How often the loop also looks at the replicated values: catches a snapshot installed on
this node, which restores kv without an apply."""

Scalar = int | str


class Carrier(enum.Enum):
    KV = "kv"  # one kv update (raftlog.update)
    TIMER = "timer"  # the timer's switch command (TimerService.set_switches)


@dataclass(frozen=True, slots=True)
class Replicated:
    """How one runtime key is replicated."""

    name: str
    kv_key: str
    carrier: Carrier
    encode: Callable[[Any], Scalar]
    decode: Callable[[object], Any]
    """The key's value from the kv entry; ValueError when it holds none."""
    switch: str = ""
    """For :attr:`Carrier.TIMER`: the switch's name in ``set_switches``."""


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"not a string: {value!r}")
    return value


def _flag(value: object) -> bool:
    if type(value) is not int or value not in (0, 1):
        raise ValueError(f"not 0 or 1: {value!r}")
    return value == 1


def _float(value: object) -> float:
    return float(_str(value))


def _mode(value: object) -> bool:
    if value == ASYNC:
        return True
    if value == SYNC:
        return False
    raise ValueError(f"not {ASYNC!r} or {SYNC!r}: {value!r}")


def _plain(name: str) -> Replicated:
    kind = KEY_BY_NAME[name].type
    if kind is bool:
        return Replicated(name, PREFIX + name, Carrier.KV, int, _flag)
    if kind is float:
        return Replicated(name, PREFIX + name, Carrier.KV, lambda v: repr(float(v)), _float)
    if kind is str:
        return Replicated(name, PREFIX + name, Carrier.KV, str, _str)
    raise AssertionError(f"no kv encoding for {name} ({kind.__name__})")


REPLICATED: Final[Mapping[str, Replicated]] = {
    r.name: r
    for r in (
        _plain("log_level"),
        _plain("ops_log_enabled"),
        _plain("ops_log_sample_rate"),
        Replicated(
            "enable_schedule_async_deliver",
            MODE_KEY,
            Carrier.KV,
            lambda v: ASYNC if v else SYNC,
            _mode,
        ),
        Replicated("timer_stop_enqueue", STOP_ENQUEUE, Carrier.TIMER, int, _flag, "stop_enqueue"),
        Replicated("timer_stop_dequeue", STOP_DEQUEUE, Carrier.TIMER, int, _flag, "stop_dequeue"),
    )
}
RUNTIME_KEYS: Final = tuple(k.name for k in KEYS if k.runtime)
if set(RUNTIME_KEYS) != set(REPLICATED):  # a runtime key must say how it is replicated
    raise AssertionError(f"runtime keys {RUNTIME_KEYS} != replicated {sorted(REPLICATED)}")
_WATCHED: Final = tuple(r.kv_key for r in REPLICATED.values())


# ---------------------------------------------------------------------- the core (no I/O)


def validate(body: object) -> dict[str, Any]:
    """The changes a PATCH body asks for, checked: every key first (unknown: 400
    ``unknown_key``; not runtime: 409 ``not_runtime``), then every value with the key's own
    type and limits (400 ``invalid_config``). Each error names the key."""
    if not isinstance(body, dict) or not body:
        raise bad_request(
            'the body must be an object of key: value, e.g. {"log_level": "warning"}', "body"
        )
    names = {given: current_name(given) for given in body}  # a renamed key's old name too
    for given, name in names.items():
        if name not in KEY_BY_NAME:
            raise bad_request(f"unknown config key {given!r}", given, "unknown_key")
        if name not in REPLICATED:
            raise ApiError(
                409,
                "not_runtime",
                f"{name} can only be changed in the config file, with a restart",
                given,
            )
    changes: dict[str, Any] = {}
    for given, value in body.items():
        name = names[given]
        try:
            changes[name] = parse_value(name, value)
        except ConfigError as exc:
            raise bad_request(f"{name}: {exc.problem}", given, "invalid_config") from None
    return changes


@dataclass(frozen=True, slots=True)
class Plan:
    """The replicated writes that make ``changes`` cluster-wide."""

    kv: dict[str, Scalar]
    """One kv update (``cfg/*``, ``sched/mode``)."""
    timer: dict[str, bool]
    """One timer switch command (``stop_enqueue``, ``stop_dequeue``)."""


def plan(changes: Mapping[str, Any]) -> Plan:
    kv: dict[str, Scalar] = {}
    timer: dict[str, bool] = {}
    for name, value in changes.items():
        r = REPLICATED[name]
        if r.carrier is Carrier.TIMER:
            timer[r.switch] = bool(value)
        else:
            kv[r.kv_key] = r.encode(value)
    return Plan(kv, timer)


@dataclass(frozen=True, slots=True)
class Overrides:
    values: dict[str, Any]
    """Runtime key -> the cluster's value, for each key the cluster has set."""
    problems: tuple[str, ...] = ()
    """Entries that hold no value their key accepts (ignored)."""


def read_overrides(kv: Mapping[str, object]) -> Overrides:
    """The values the cluster has replicated, from the store's kv (any thread: a few reads)."""
    values: dict[str, Any] = {}
    problems: list[str] = []
    for r in REPLICATED.values():
        raw = kv.get(r.kv_key)
        if raw is None:
            continue
        try:
            values[r.name] = parse_value(r.name, r.decode(raw))
        except (ValueError, ConfigError) as exc:
            problems.append(f"{r.kv_key} = {raw!r} is no value of {r.name} ({exc}); ignored")
    return Overrides(values, tuple(problems))


def watched(kv: Mapping[str, object]) -> tuple[object, ...]:
    """The replicated entries, cheap enough for every apply: compare with the last seen."""
    return tuple(kv.get(k) for k in _WATCHED)


def effective(file_config: NodeConfig, overrides: Mapping[str, Any]) -> NodeConfig:
    """``file_config`` overlaid with the cluster's values."""
    return file_config.with_changes(overrides) if overrides else file_config


def differences(old: NodeConfig, new: NodeConfig) -> list[tuple[str, Any, Any]]:
    """``(key, old, new)`` for each runtime key whose value differs, in :data:`KEYS` order."""
    return [
        (name, getattr(old, name), getattr(new, name))
        for name in RUNTIME_KEYS
        if getattr(old, name) != getattr(new, name)
    ]


def level_number(level: str) -> int:
    number = logging.getLevelName(level.upper())
    return number if isinstance(number, int) else logging.INFO


# ---------------------------------------------------------------------- the driver


class RuntimeConfig:
    """Keeps ``broker.config`` the effective config, on this node's loop.

    ``set_log_level`` changes the process's log level (:func:`chronomq.cluster.logs.stdlog.set_level`);
    ``hooks`` get ``{key: new value}`` of every change (the ops log writer's).
    """

    def __init__(
        self,
        broker: Broker,
        hooks: list[Callable[[dict[str, Any]], None]],
        set_log_level: Callable[[str], None],
    ) -> None:
        self._broker = broker
        self.file_config = broker.config
        self._hooks = hooks
        self._set_log_level = set_log_level
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seen: tuple[object, ...] | None = None  # Raft thread
        self._refreshed: tuple[object, ...] | None = None  # loop
        self._reported: set[str] = set()
        self._poller: asyncio.Task[None] | None = None
        # What the cluster had set when last refreshed: a value committed again, equal to
        # the effective one, is still an operator's change (logged, and an ops event).
        self._set: dict[str, Any] = read_overrides(self._kv).values
        broker.raftlog.add_apply_listener(self._on_apply)

    @property
    def _kv(self) -> Mapping[str, object]:
        return self._broker.raftlog.store.kv

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.refresh()
        self._poller = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        self._loop = None
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    def overrides(self) -> dict[str, Any]:
        """The runtime keys the cluster has set, and their values."""
        return read_overrides(self._kv).values

    def _on_apply(self, _result: ApplyResult) -> None:
        # Raft thread: a handful of dict reads; cross to the loop only on a change.
        loop = self._loop
        if loop is None:
            return
        now = watched(self._kv)
        if now == self._seen:
            return
        self._seen = now
        with contextlib.suppress(RuntimeError):  # the loop is closing
            loop.call_soon_threadsafe(self.refresh)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            if watched(self._kv) != self._refreshed:
                self.refresh()

    def refresh(self) -> dict[str, Any]:
        """Make ``broker.config`` the effective config now; ``{key: new value}`` changed."""
        self._refreshed = watched(self._kv)
        found = read_overrides(self._kv)
        for problem in found.problems:
            if problem not in self._reported and len(self._reported) < 100:
                self._reported.add(problem)
                log.warning("replicated config: %s", problem)
        broker = self._broker
        new = effective(self.file_config, found.values)
        diffs = differences(broker.config, new)
        newly_set = {k: v for k, v in found.values.items() if k not in self._set}
        self._set = dict(found.values)
        if not diffs and not newly_set:
            return {}
        level = next((d for d in diffs if d[0] == "log_level"), None)
        louder = level is not None and level_number(level[2]) < level_number(level[1])
        if level is not None and louder:
            self._set_log_level(level[2])  # first, so that the line below is written
        for name, old, value in diffs:
            log.info("config changed cluster-wide: %s %s → %s", name, _show(old), _show(value))
        broker.config = new
        if level is not None and not louder:
            self._set_log_level(level[2])
        changes = {name: value for name, _, value in diffs}
        for name, value in newly_set.items():
            if name not in changes:
                log.info("config set cluster-wide: %s = %s (as before)", name, _show(value))
                changes[name] = value
        for hook in self._hooks:
            try:
                hook(changes)
            except Exception:
                log.exception("config hook failed for %s", sorted(changes))
        return changes


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ---------------------------------------------------------------------- the API's shapes

_JSON_TYPES: Final = {bool: "boolean", int: "integer", float: "number", str: "string"}


def patch_schema() -> dict[str, Any]:
    """The request body of ``PATCH /v1/admin/config``, from the keys' own declarations."""
    props: dict[str, Any] = {}
    for name in RUNTIME_KEYS:
        key = KEY_BY_NAME[name]
        prop: dict[str, Any] = {"type": _JSON_TYPES[key.type], "description": key.doc}
        if key.choices:
            prop["enum"] = list(key.choices)
        if key.min is not None:
            prop["minimum"] = key.min
        if key.max is not None:
            prop["maximum"] = key.max
        props[name] = prop
    return {
        "type": "object",
        "properties": props,
        "additionalProperties": False,
        "minProperties": 1,
        "description": "an unknown key answers 400 unknown_key, a key that is not runtime 409 "
        "not_runtime, a bad value 400 invalid_config; each names the key in field",
    }


def answer_schema(patch: bool) -> dict[str, Any]:
    """The answer of ``GET`` (``patch`` False) and ``PATCH /v1/admin/config``."""
    props: dict[str, Any] = {
        "config": {"type": "object", "description": "the effective config, secrets masked"},
        "runtime": {
            "type": "object",
            "description": "the runtime keys the cluster has set, and their values (the same "
            "on every node once applied); a key not listed has the node's file value",
        },
        "runtime_keys": {"type": "array", "items": {"type": "string"}},
    }
    if patch:
        props["changed"] = {"type": "array", "items": {"type": "string"}}
        props["applied_index"] = {
            "type": "integer",
            "description": "the answering node had applied the change at this Raft index",
        }
    return {"type": "object", "properties": props}
