"""What a node renews for ``auto_renew`` receives, and when (no I/O: ``now_ms`` is an argument).

A push consumer receives with ``auto_renew`` and no invisible time of its own. RocketMQ's proxy
keeps such hand-outs in its receipt-handle manager and changes their invisible time shortly
before it runs out, until the consumer is done with them; the node that served the receive
does the same here. :class:`RenewRegistry` holds what it renews and decides; the driver
(:mod:`chronomq.cluster.rocketmq.autorenew`) does the calls.

A tracked hand-out is (first receipt handle -> newest receipt handle, group, topic, client id,
received ms, invisible-until ms). A renewal is a change of invisible time, which gives the
hand-out a new handle (the old one is stale from then on,
:mod:`chronomq.pop`), so the registry maps the handle the client holds to the newest
one, and an ack, a change or a forward to the DLQ with the client's handle acts on the newest
(:meth:`RenewRegistry.hold`), as RocketMQ's proxy swaps handles on ack.

- **Due**: less than a third of ``invisible_ms`` is left (``invisible_until_ms - now_ms <=
  invisible_ms // 3``); each renewal adds ``invisible_ms`` again. Due ones come most urgent
  first (:meth:`RenewRegistry.sweep`).
- **Stops** (:class:`StopReason`): the client acks, changes the invisible time or forwards to
  the DLQ (its handle goes through :meth:`~RenewRegistry.hold` /
  :meth:`~RenewRegistry.release`); a renewal is refused because the hand-out is over (acked,
  revived and maybe handed to someone else: ``stale``); nothing heard from the client for
  ``client_expired_ms`` (heartbeats, telemetry or any call naming its client id; RocketMQ
  expires a client channel after 120 s), or the client said it terminates; ``max_renew_ms``
  since the receive (RocketMQ's ``renewMaxTimeMillis``, 3 h); ``dropped`` at the bound.
- **Bound**: at most ``max_tracked`` hand-outs; tracking one more drops the oldest (by
  receive), which then simply comes back at the end of its current invisible time. Clients
  are remembered only while they hold tracked hand-outs, so the client table is bounded by
  the same number and a stream of made-up client ids cannot push real ones out.
- **Rate**: :class:`TokenBucket` bounds renewals per second, so no consumer, however large or
  hostile, makes the node write more than that to the Raft log.

A receive without a client id is not tracked: nothing would tell when its consumer went away.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

CLIENT_EXPIRED_MS: Final = 120_000
"""A client not heard from for this long has gone away (RocketMQ's ``channelExpiredTimeout``;
the official clients send a heartbeat every 10 s)."""
MAX_CLIENT_ID_CHARS: Final = 256
"""A longer client id is not a real one: such a receive is not tracked."""


class StopReason(Enum):
    """Why a hand-out is no longer renewed (the label of the ``stopped`` metric)."""

    ACKED = "acked"
    CHANGED = "changed"
    DLQ = "dlq"
    STALE = "stale"
    CLIENT_GONE = "client_gone"
    MAX_TIME = "max_time"
    DROPPED = "dropped"


@dataclass(slots=True)
class Tracked:
    """One hand-out being renewed (mutable: the registry's own record)."""

    original: str
    """The receipt handle the client received and will ack with."""
    current: str
    """The newest receipt handle of the hand-out (``original`` until the first renewal)."""
    group: str
    topic: str
    client_id: str
    received_ms: int
    invisible_until_ms: int
    renewals: int = 0
    renewing: bool = False
    """A renewal of it is in flight: its outcome decides ``current``."""
    held: int = 0
    """Client calls (ack, change, DLQ) acting on it now: it is not renewed meanwhile."""


@dataclass(slots=True)
class _Client:
    last_seen_ms: int
    tracked: int = 0


@dataclass(frozen=True, slots=True)
class Sweep:
    """What :meth:`RenewRegistry.sweep` found: hand-outs due (most urgent first), and those it
    stopped tracking, with why."""

    due: tuple[Tracked, ...] = ()
    stopped: tuple[tuple[Tracked, StopReason], ...] = field(default=())


class RenewRegistry:
    """The hand-outs one node renews; every method takes the time it acts at."""

    def __init__(
        self,
        *,
        invisible_ms: int,
        max_renew_ms: int,
        max_tracked: int,
        client_expired_ms: int = CLIENT_EXPIRED_MS,
    ) -> None:
        if invisible_ms <= 0 or max_renew_ms <= 0 or max_tracked <= 0 or client_expired_ms <= 0:
            raise ValueError("renewal times and bounds must be positive")
        self.invisible_ms = invisible_ms
        self.ahead_ms = invisible_ms // 3
        self.max_renew_ms = max_renew_ms
        self.max_tracked = max_tracked
        self.client_expired_ms = client_expired_ms
        self._entries: dict[str, Tracked] = {}
        """By first handle, oldest receive first."""
        self._clients: dict[str, _Client] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, handle: object) -> bool:
        return handle in self._entries

    def get(self, handle: str) -> Tracked | None:
        return self._entries.get(handle)

    def clients(self) -> int:
        """Clients remembered (those holding tracked hand-outs)."""
        return len(self._clients)

    # ------------------------------------------------------------------ hand-outs

    def track(
        self,
        handle: str,
        *,
        group: str,
        topic: str,
        client_id: str,
        invisible_until_ms: int,
        now_ms: int,
    ) -> list[Tracked]:
        """Renew ``handle`` from now on; the oldest hand-outs dropped to make room."""
        if handle in self._entries:
            return []
        dropped = []
        while len(self._entries) >= self.max_tracked:
            dropped.append(self._remove(next(iter(self._entries))))
        self._entries[handle] = Tracked(
            handle, handle, group, topic, client_id, now_ms, invisible_until_ms
        )
        client = self._clients.get(client_id)
        if client is None:
            client = self._clients[client_id] = _Client(now_ms)
        client.last_seen_ms = max(client.last_seen_ms, now_ms)
        client.tracked += 1
        return dropped

    def _remove(self, handle: str) -> Tracked:
        entry = self._entries.pop(handle)
        client = self._clients.get(entry.client_id)
        if client is not None:
            client.tracked -= 1
            if client.tracked <= 0:
                del self._clients[entry.client_id]
        return entry

    # ------------------------------------------------------------------ clients

    def saw_client(self, client_id: str, now_ms: int) -> None:
        """The client made a call (a heartbeat, telemetry, a receive, an ack...)."""
        client = self._clients.get(client_id)
        if client is not None:
            client.last_seen_ms = max(client.last_seen_ms, now_ms)

    def client_gone(self, client_id: str) -> list[Tracked]:
        """The client said it terminates: stop renewing what it holds."""
        if client_id not in self._clients:
            return []
        return [self._remove(h) for h, e in list(self._entries.items()) if e.client_id == client_id]

    def _client_alive(self, client_id: str, now_ms: int) -> bool:
        client = self._clients.get(client_id)
        return client is not None and now_ms - client.last_seen_ms < self.client_expired_ms

    # ------------------------------------------------------------------ renewing

    def sweep(self, now_ms: int) -> Sweep:
        """Hand-outs to renew now, most urgent first, and those that stop being renewed
        (their client went away, or renew time is over); the stopped ones are forgotten."""
        due: list[Tracked] = []
        stopped: list[tuple[Tracked, StopReason]] = []
        for handle, entry in list(self._entries.items()):
            if entry.renewing or entry.held:
                continue
            if not self._client_alive(entry.client_id, now_ms):
                stopped.append((self._remove(handle), StopReason.CLIENT_GONE))
            elif entry.invisible_until_ms - now_ms > self.ahead_ms:
                continue
            elif now_ms - entry.received_ms >= self.max_renew_ms:
                stopped.append((self._remove(handle), StopReason.MAX_TIME))
            else:
                due.append(entry)
        due.sort(key=lambda e: (e.invisible_until_ms, e.received_ms))
        return Sweep(tuple(due), tuple(stopped))

    def begin_renew(self, handles: Iterable[str]) -> list[Tracked]:
        """Mark for renewal those of ``handles`` still tracked and not in use; they are what
        to renew (with their ``current`` handle)."""
        out = []
        for h in handles:
            entry = self._entries.get(h)
            if entry is None or entry.renewing or entry.held:
                continue
            entry.renewing = True
            out.append(entry)
        return out

    def renewed(self, handle: str, new_handle: str, invisible_until_ms: int) -> bool:
        """The renewal of ``handle`` committed: ``new_handle`` is the newest. False when the
        hand-out stopped being tracked meanwhile (dropped at the bound)."""
        entry = self._entries.get(handle)
        if entry is None:
            return False
        entry.current = new_handle
        entry.invisible_until_ms = invisible_until_ms
        entry.renewals += 1
        entry.renewing = False
        return True

    def refused(self, handle: str) -> Tracked | None:
        """The renewal was refused: the hand-out is over (acked, revived, handed to another,
        or sent to the DLQ). Forget it."""
        if handle not in self._entries:
            return None
        return self._remove(handle)

    def failed(self, handle: str) -> None:
        """The renewal's outcome is unknown (no leader, a timeout): try again when next due."""
        entry = self._entries.get(handle)
        if entry is not None:
            entry.renewing = False

    # ------------------------------------------------------------------ the client's calls

    def renewing(self, handle: str) -> bool:
        entry = self._entries.get(handle)
        return entry is not None and entry.renewing

    def hold(self, handle: str, now_ms: int) -> str:
        """The handle to act on for a client's ack, change or forward of ``handle``: the
        newest when it is tracked (then not renewed until :meth:`release`). A renewal in
        flight must end first (see :meth:`renewing`): until then the newest is not known."""
        entry = self._entries.get(handle)
        if entry is None:
            return handle
        if entry.renewing:
            raise ValueError("a renewal of this handle is in flight")
        entry.held += 1
        self.saw_client(entry.client_id, now_ms)
        return entry.current

    def release(self, handle: str, finished: bool) -> Tracked | None:
        """The client's call on ``handle`` ended. ``finished`` (acked, changed, forwarded, or
        the hand-out was over): forget it and return it. Otherwise (the call failed, it may be
        retried) renew it again."""
        entry = self._entries.get(handle)
        if entry is None:
            return None
        entry.held = max(0, entry.held - 1)
        if finished:
            return self._remove(handle)
        return None


class TokenBucket:
    """At most ``rate_per_s`` a second on average, ``burst`` at once (no I/O; a clock that
    goes back adds nothing)."""

    def __init__(self, rate_per_s: float, now_ms: int, burst: float | None = None) -> None:
        if rate_per_s <= 0:
            raise ValueError("rate_per_s must be positive")
        self.rate_per_s = rate_per_s
        self.burst = max(1.0, burst if burst is not None else rate_per_s)
        self._tokens = self.burst
        self._at_ms = now_ms

    def take(self, wanted: int, now_ms: int) -> int:
        """How many of ``wanted`` may go now (taken from the bucket)."""
        if now_ms > self._at_ms:
            self._tokens = min(
                self.burst, self._tokens + (now_ms - self._at_ms) * self.rate_per_s / 1000
            )
            self._at_ms = now_ms
        n = max(0, min(wanted, int(self._tokens)))
        self._tokens -= n
        return n


def client_id_problem(client_id: object) -> str | None:
    """Why ``client_id`` cannot key a client (then its receives are not tracked), or None."""
    if not isinstance(client_id, str) or not client_id:
        return "no client id"
    if len(client_id) > MAX_CLIENT_ID_CHARS:
        return f"a client id is at most {MAX_CLIENT_ID_CHARS} characters"
    return None
