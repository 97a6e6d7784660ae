"""Synthetic node logs that look like a real 3-node run: ``chronomq logs synth``.

The story, scaled to the number of latency rows asked for: producers send at ``rate_per_s``
(a Poisson stream whose rate swings +-30 % over the run), 40 % plain messages, 40 % delay-level
messages (mostly the short levels) and 20 % timers. Node ``n0`` leads term 1; at 40 % of the run a
drill kills it and ``n1`` takes over after a 450 ms gap without commits (``n0`` comes back 5 s
later and catches up, which shows as a spike of apply lag); at 75 % leadership is transferred to
``n2`` (a 60 ms gap). Deliveries due inside a gap come out in a burst when the new leader starts.

Lateness: delay levels are scanned every 100 ms (uniform 0-100 ms plus a small exponential tail
and rare 0.1-1.5 s stalls); timers have 100 ms slots and a smaller tail; node clocks differ by a
few milliseconds, so deliveries by a node whose clock is behind the storing node's can look a
little early. 97 % of the messages are consumed, a few seconds late for 1 % of them.

Lines are formatted directly (not through :mod:`chronomq.cluster.logs.schema` objects) for speed: 10 M latency rows
take well under a minute. Tests decode every line with :func:`chronomq.cluster.logs.schema.decode`.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from chronomq.cluster.logs.schema import SCHEMA_VERSION, RecordType
from chronomq.cluster.logs.writer import RotatingFile

DELAY_LEVELS_MS = tuple(
    s * 1000
    for s in (1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200)
)
"""RocketMQ's default ``message_delay_level`` table, in milliseconds."""

_LEVEL_WEIGHTS = (30, 24, 16, 10, 6, 4, 2, 2, 1, 1, 1, 1, 0.5, 0.5, 0.3, 0.3, 0.2, 0.2)
_TOPICS = (("orders", 45), ("payments", 25), ("notifications", 20), ("audit", 10))
_CLOCK_SKEW_MS = (0, 1, -1, 2, -2, 1, 0, -1, 2)
_CHUNK_LINES = 50_000
_ROWS_PER_MESSAGE = 0.4 * 1.97 + 0.6 * 2.97  # plain: stored+consumed; delayed: +delivered
_LEADER_SERVICES = ("schedule", "timer")
_DRILL = "drill"  # the failover drill's own events directory

MAX_ROWS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class SynthSpec:
    rows: int
    nodes: int = 3
    rate_per_s: int = 5_000
    seed: int = 1
    start_ms: int = 1_700_000_000_000
    rotate_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 1 <= self.rows <= MAX_ROWS:
            raise ValueError(f"rows must be within 1..{MAX_ROWS}, got {self.rows}")
        if not 3 <= self.nodes <= len(_CLOCK_SKEW_MS):
            raise ValueError(f"nodes must be within 3..{len(_CLOCK_SKEW_MS)}, got {self.nodes}")
        if not 1 <= self.rate_per_s <= 10_000_000:
            raise ValueError(f"rate_per_s must be within 1..10000000, got {self.rate_per_s}")
        if self.start_ms < 0:
            raise ValueError(f"start_ms must be >= 0, got {self.start_ms}")


@dataclass(frozen=True, slots=True)
class _Gap:
    """No commits in [start_ms, end_ms): the old leader's last commit to the new one's first."""

    start_ms: int
    end_ms: int
    old_leader: int
    new_leader: int
    new_term: int


@dataclass(frozen=True, slots=True)
class SynthResult:
    out_dir: str
    latency_rows: int
    replication_rows: int
    event_rows: int
    messages: int
    files: int
    bytes_written: int
    first_ms: int
    last_ms: int
    elapsed_s: float

    def as_dict(self) -> dict[str, object]:
        return {
            "out_dir": self.out_dir,
            "latency_rows": self.latency_rows,
            "replication_rows": self.replication_rows,
            "event_rows": self.event_rows,
            "messages": self.messages,
            "files": self.files,
            "bytes_written": self.bytes_written,
            "first_ms": self.first_ms,
            "last_ms": self.last_ms,
            "elapsed_s": round(self.elapsed_s, 3),
            "latency_rows_per_s": round(self.latency_rows / max(self.elapsed_s, 1e-9)),
        }


class _Sink:
    """Buffered lines per node and record type, written in chunks through RotatingFile."""

    def __init__(self, root: Path, nodes: list[str], rotate_bytes: int) -> None:
        self._files: dict[tuple[str, RecordType], RotatingFile] = {}
        self._buffers: dict[tuple[str, RecordType], list[bytes]] = {}
        for node in nodes:
            (root / node).mkdir(parents=True, exist_ok=True)
            for record_type in RecordType:
                key = (node, record_type)
                self._files[key] = RotatingFile(root / node, record_type, rotate_bytes)
                self._buffers[key] = []
        self.rows = dict.fromkeys(RecordType, 0)
        self.bytes_written = 0

    def add(self, node: str, record_type: RecordType, line: str) -> None:
        buffer = self._buffers[(node, record_type)]
        buffer.append(line.encode())
        if len(buffer) >= _CHUNK_LINES:
            self._flush(node, record_type)

    def _flush(self, node: str, record_type: RecordType) -> None:
        key = (node, record_type)
        lines = self._buffers[key]
        if lines:
            self._files[key].write(lines)
            self.rows[record_type] += len(lines)
            self.bytes_written += sum(len(x) for x in lines)
            self._buffers[key] = []

    def close(self) -> int:
        for node, record_type in list(self._buffers):
            self._flush(node, record_type)
        for f in self._files.values():
            f.close()
        return sum(f.opened for f in self._files.values())


def _cumulative(weights: tuple[float, ...]) -> list[float]:
    return list(itertools.accumulate(w / sum(weights) for w in weights))


def _event(ts_ms: int, node: str, kind: str, detail: dict[str, object]) -> str:
    record = {"v": SCHEMA_VERSION, "t": "events", "ts_ms": ts_ms, "node": node, "type": kind}
    record["detail"] = detail
    return orjson.dumps(record).decode() + "\n"


class _Story:
    """Who leads when, who is down, where the failover gaps are: the run's timeline."""

    def __init__(self, spec: SynthSpec) -> None:
        self.start_ms = spec.start_ms
        self.span_ms = max(2_000, int(spec.rows / _ROWS_PER_MESSAGE / spec.rate_per_s * 1000))
        kill_ms = spec.start_ms + int(self.span_ms * 0.40)
        transfer_ms = spec.start_ms + int(self.span_ms * 0.75)
        self.kill = _Gap(kill_ms, kill_ms + 450, old_leader=0, new_leader=1, new_term=2)
        self.transfer = _Gap(transfer_ms, transfer_ms + 60, old_leader=1, new_leader=2, new_term=3)
        self.gaps = (self.kill, self.transfer)
        self.n0_back_ms = self.kill.end_ms + 5_000

    def leader_at(self, ts: int) -> int:
        return 0 if ts < self.kill.start_ms else 1 if ts < self.transfer.start_ms else 2

    def term_at(self, ts: int) -> int:
        return 1 if ts < self.kill.start_ms else 2 if ts < self.transfer.start_ms else 3

    def in_gap(self, ts: int) -> _Gap | None:
        for gap in self.gaps:
            if gap.start_ms <= ts < gap.end_ms:
                return gap
        return None

    def alive(self, node: int, ts: int) -> bool:
        return node != 0 or not self.kill.start_ms <= ts < self.n0_back_ms


def synth_logs(out_dir: str | Path, spec: SynthSpec) -> SynthResult:
    """Write ``spec.rows`` latency rows plus the matching replication and event logs."""
    started = time.monotonic()
    root = Path(out_dir).absolute()
    names = [f"n{i}" for i in range(spec.nodes)]
    sink = _Sink(root, [*names, _DRILL], spec.rotate_bytes)
    rnd = random.Random(spec.seed)
    story = _Story(spec)
    messages, last_ms = _write_latency(sink, spec, rnd, names, story)
    _write_replication(sink, spec, rnd, names, story, last_ms)
    _write_events(sink, names, story, last_ms)
    files = sink.close()
    return SynthResult(
        out_dir=str(root),
        latency_rows=sink.rows[RecordType.LATENCY],
        replication_rows=sink.rows[RecordType.REPLICATION],
        event_rows=sink.rows[RecordType.EVENTS],
        messages=messages,
        files=files,
        bytes_written=sink.bytes_written,
        first_ms=spec.start_ms,
        last_ms=last_ms,
        elapsed_s=time.monotonic() - started,
    )


def _write_latency(
    sink: _Sink, spec: SynthSpec, rnd: random.Random, names: list[str], story: _Story
) -> tuple[int, int]:
    """Latency rows; returns (messages, last timestamp written)."""
    # Delays longer than half the run would mostly fall due after it: leave them out.
    max_delay_ms = max(DELAY_LEVELS_MS[0], story.span_ms // 2)
    levels = sum(1 for d in DELAY_LEVELS_MS if d <= max_delay_ms)
    level_cdf = _cumulative(_LEVEL_WEIGHTS[:levels])
    log_min_timer, log_max_timer = math.log(500), math.log(min(300_000, max(1_000, max_delay_ms)))
    topic_cdf = _cumulative(tuple(w for _, w in _TOPICS))
    topics = [t for t, _ in _TOPICS]
    rand, expo, uniform = rnd.random, rnd.expovariate, rnd.uniform
    leader_at, in_gap = story.leader_at, story.in_gap
    rows = 0
    msg = 0
    now = float(spec.start_ms)
    last_ms = spec.start_ms
    mean_gap_ms = 1000.0 / spec.rate_per_s
    id_prefix = f"{spec.seed & 0xFFFFFFFF:08X}"
    n_nodes = len(names)
    latency = RecordType.LATENCY
    while rows < spec.rows:
        swing = 1.0 + 0.3 * math.sin(6 * math.pi * (now - spec.start_ms) / story.span_ms)
        now += expo(1.0) * mean_gap_ms / swing
        true_store = int(now)
        gap = in_gap(true_store)
        if gap is not None:  # producers wait for the new leader
            true_store = gap.end_ms + int(uniform(0, 3))
        leader = leader_at(true_store)
        skew_store = _CLOCK_SKEW_MS[leader]
        store = true_store + skew_store
        msg_id = f"{id_prefix}{msg:024X}"
        msg += 1
        topic = topics[bisect.bisect_left(topic_cdf, rand())]
        u = rand()
        head = f'{{"v":{SCHEMA_VERSION},"t":"latency","msg_id":"{msg_id}","topic":"{topic}",'
        delivered = None
        deliverer = leader
        if u < 0.4:
            kind = '"kind":"plain",'
            due = None
        else:
            if u < 0.8:
                level = bisect.bisect_left(level_cdf, rand()) + 1
                kind = f'"kind":"level","level":{level},'
                due = store + DELAY_LEVELS_MS[level - 1]
                late = uniform(0, 100) + expo(1 / 3.0)
                if rand() < 0.001:
                    late += uniform(100, 1500)
            else:
                kind = '"kind":"timer",'
                due = store + int(math.exp(uniform(log_min_timer, log_max_timer)))
                late = uniform(0, 100) + expo(1 / 1.5)
            true_delivered = due - skew_store + int(late)
            gap = in_gap(true_delivered)
            if gap is not None:  # the new leader catches up on what fell due meanwhile
                true_delivered = gap.end_ms + int(uniform(0, 40))
            deliverer = leader_at(true_delivered)
            delivered = true_delivered + _CLOCK_SKEW_MS[deliverer]
        times = f'"store_ms":{store}' + ("" if due is None else f',"due_ms":{due}')
        node = names[leader]
        sink.add(node, latency, f'{head}{kind}"stage":"stored","node":"{node}",{times}}}\n')
        rows += 1
        ready = store
        if delivered is not None and rows < spec.rows:
            node = names[deliverer]
            times += f',"delivered_ms":{delivered}'
            sink.add(node, latency, f'{head}{kind}"stage":"delivered","node":"{node}",{times}}}\n')
            rows += 1
            ready = delivered
        last_ms = max(last_ms, ready)
        if rows < spec.rows and rand() < 0.97:
            consumed = ready + 1 + int(expo(1 / 4.0))
            if rand() < 0.01:  # a consumer rebalancing
                consumed += int(uniform(500, 3000))
            served = int(rand() * n_nodes)
            if not story.alive(served, consumed):
                served = leader_at(consumed)
            node = names[served]
            times += f',"consumed_ms":{consumed}'
            sink.add(node, latency, f'{head}{kind}"stage":"consumed","node":"{node}",{times}}}\n')
            rows += 1
            last_ms = max(last_ms, consumed)
    return msg, last_ms


def _write_replication(
    sink: _Sink, spec: SynthSpec, rnd: random.Random, names: list[str], story: _Story, end_ms: int
) -> None:
    """Group-committed commands (~200/s, none inside a gap), one line per node that applied."""
    expo, uniform, rand = rnd.expovariate, rnd.uniform, rnd.random
    per_command = max(1.0, spec.rate_per_s * 1.6 / 200)
    replication = RecordType.REPLICATION
    kill = story.kill
    caught_up_ms = float(story.n0_back_ms + 300)  # n0 restarts, then is sent what it missed
    index = 0
    now = float(spec.start_ms)
    resume_ms: int | None = None
    while now < end_ms:
        step = 1 + expo(1 / 4.0)
        crossed = next((g for g in story.gaps if now < g.start_ms <= now + step), None)
        if crossed is not None:
            # The old leader's last command commits just before it goes away, covering its
            # last deliveries; the next one is the new leader's, as the gap ends.
            propose, commit = max(int(now), crossed.start_ms - 2), crossed.start_ms - 1
            now, resume_ms = float(crossed.start_ms), crossed.end_ms
        else:
            if resume_ms is not None:
                now, resume_ms = float(resume_ms), None
            else:
                now += step
            propose = int(now)
            commit = propose + int(rnd.lognormvariate(0.2, 0.6))
            for g in story.gaps:
                if propose < g.start_ms <= commit:
                    commit = g.start_ms - 1
        index += 1
        term, leader = story.term_at(propose), story.leader_at(propose)
        msgs = max(1, int(per_command * (0.5 + rand())))
        size = 48 + msgs * int(230 + uniform(0, 60))
        skew = _CLOCK_SKEW_MS[leader]
        head = f'{{"v":{SCHEMA_VERSION},"t":"replication","index":{index},"term":{term},'
        head += f'"size_bytes":{size},"msg_count":{msgs},'
        for node, name in enumerate(names):
            if node == leader:
                apply = commit + int(uniform(0, 1.2))
            elif node == 0 and commit >= kill.start_ms and caught_up_ms >= commit:
                caught_up_ms += 0.02  # n0 was down: it applies this during its catch-up
                apply = max(int(caught_up_ms), commit + 1)
            elif node == 2:  # a node with a slow disk
                apply = commit + 1 + int(expo(1 / 2.0))
                if rand() < 0.002:
                    apply += int(uniform(50, 400))
            else:
                apply = commit + int(expo(1 / 0.6))
            line = f'{head}"node":"{name}","apply_ms":{apply + _CLOCK_SKEW_MS[node]}'
            if node == leader:
                line += f',"propose_ms":{propose + skew},"commit_ms":{commit + skew}'
            sink.add(name, replication, line + "}\n")


def _write_events(sink: _Sink, names: list[str], story: _Story, end_ms: int) -> None:
    """Leader changes, services, a config change and the drill's faults, in time order."""
    start, kill, n0, back = story.start_ms, story.kill, names[0], story.n0_back_ms
    rows: list[tuple[int, str, str, dict[str, object]]] = []
    for name in names:
        rows.append((start - 900, name, "service_start", {"service": "node"}))
        rows.append((start - 400, name, "leader_change", {"leader": n0, "term": 1}))
        rows.append((end_ms + 1000, name, "service_stop", {"service": "node"}))
    rows += [(start - 390, n0, "service_start", {"service": s}) for s in _LEADER_SERVICES]
    change = {"key": "enable_schedule_async_deliver", "old": False, "new": True}
    rows.append((start + (kill.start_ms - start) // 2, n0, "config_change", change))
    rows.append((kill.start_ms, _DRILL, "drill_fault", {"fault": "kill -9", "target": n0}))
    rows.append((back - 500, _DRILL, "drill_fault", {"fault": "restart", "target": n0}))
    rows.append((back, n0, "service_start", {"service": "node"}))
    rows.append((back + 200, n0, "leader_change", {"leader": names[1], "term": 2}))
    for gap in story.gaps:
        new, old = names[gap.new_leader], names[gap.old_leader]
        detail = {"leader": new, "term": gap.new_term, "previous": old}
        for node, name in enumerate(names):
            if story.alive(node, gap.end_ms):
                rows.append((gap.end_ms - 5, name, "leader_change", detail))
        if gap is not kill:
            rows += [(gap.start_ms, old, "service_stop", {"service": s}) for s in _LEADER_SERVICES]
        rows += [(gap.end_ms - 4, new, "service_start", {"service": s}) for s in _LEADER_SERVICES]
    for ts, writer, kind, detail in sorted(rows, key=lambda r: r[0]):
        sink.add(writer, RecordType.EVENTS, _event(ts, writer, kind, detail))
