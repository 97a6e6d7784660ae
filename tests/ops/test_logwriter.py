"""The background log writer: rotation, drops when full, never blocking, sampling, draining."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chronomq.cluster.logs import writer as logwriter
from chronomq.cluster.logs.schema import (
    EventRecord,
    EventType,
    LatencyRecord,
    MessageKind,
    RecordType,
    ReplicationRecord,
    Stage,
    decode,
    encode,
)
from chronomq.cluster.logs.writer import LogWriter, LogWriterConfig, keep_sample

DEADLINE_S = 20.0


def latency(i: int) -> LatencyRecord:
    return LatencyRecord(
        msg_id=f"M{i:08d}",
        topic="orders",
        kind=MessageKind.TIMER,
        stage=Stage.STORED,
        node="n0",
        store_ms=1_000 + i,
        due_ms=2_000 + i,
    )


def lines(directory: Path, record_type: RecordType) -> list[bytes]:
    out: list[bytes] = []
    for path in sorted(directory.glob(f"{record_type}-*.jsonl")):
        out += path.read_bytes().splitlines()
    return out


@pytest.fixture
def blocked_sink(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Make the writer thread hang inside its first file write until the event is set."""
    release = threading.Event()
    entered = threading.Event()
    real_write = logwriter.RotatingFile.write

    def slow_write(self: logwriter.RotatingFile, batch: list[bytes]) -> None:
        entered.set()
        release.wait(DEADLINE_S)
        real_write(self, batch)

    monkeypatch.setattr(logwriter.RotatingFile, "write", slow_write)
    release.entered = entered  # type: ignore[attr-defined]
    yield release
    release.set()


def test_writes_every_record_as_a_json_line(tmp_path: Path) -> None:
    with LogWriter(tmp_path, "n0") as writer:
        for i in range(1_000):
            assert writer.write(latency(i))
        writer.write(ReplicationRecord(5, 1, 100, 2, "n0", apply_ms=10, propose_ms=8, commit_ms=9))
        writer.write(EventRecord(1, "n0", EventType.SERVICE_START, {"service": "node"}))
    stats = writer.stats()
    assert stats.written == stats.accepted == 1_002 and stats.dropped == 0
    got = [decode(line, RecordType.LATENCY) for line in lines(tmp_path / "n0", RecordType.LATENCY)]
    assert got == [latency(i) for i in range(1_000)]
    assert len(lines(tmp_path / "n0", RecordType.REPLICATION)) == 1
    assert len(lines(tmp_path / "n0", RecordType.EVENTS)) == 1


def test_rotates_by_size_without_splitting_lines(tmp_path: Path) -> None:
    config = LogWriterConfig(rotate_bytes=4_096)
    with LogWriter(tmp_path, "n1", config) as writer:
        for i in range(2_000):
            writer.write(latency(i))
    files = sorted((tmp_path / "n1").glob("latency-*.jsonl"))
    assert len(files) > 10
    assert [f.name for f in files][:2] == ["latency-000001.jsonl", "latency-000002.jsonl"]
    for f in files:
        data = f.read_bytes()
        assert 0 < len(data) <= 4_096 and data.endswith(b"\n")
    decoded = [decode(line) for line in lines(tmp_path / "n1", RecordType.LATENCY)]
    assert decoded == [latency(i) for i in range(2_000)]
    assert writer.stats().files_opened == len(files)


def test_restart_continues_with_a_new_file(tmp_path: Path) -> None:
    with LogWriter(tmp_path, "n0") as writer:
        writer.write(latency(1))
    first = tmp_path / "n0" / "latency-000001.jsonl"
    with first.open("ab") as f:
        f.write(b'{"v":1,"t":"lat')  # a crash tore the last line
    with LogWriter(tmp_path, "n0") as writer:
        writer.write(latency(2))
    assert (tmp_path / "n0" / "latency-000002.jsonl").read_bytes() == encode(latency(2))
    assert first.read_bytes() == encode(latency(1)) + b'{"v":1,"t":"lat'


def test_full_buffer_drops_counts_and_reports(
    tmp_path: Path, blocked_sink: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    config = LogWriterConfig(buffer_records=100, flush_interval_ms=10, drain_interval_ms=5)
    writer = LogWriter(tmp_path, "n2", config).start()
    writer.write(latency(0))
    assert blocked_sink.entered.wait(DEADLINE_S)  # type: ignore[attr-defined]
    accepted = sum(writer.write(latency(i)) for i in range(1, 1_001))
    assert accepted == 100
    assert writer.stats().dropped == 900
    with caplog.at_level(logging.WARNING, logger="chronomq.logwriter"):
        blocked_sink.set()
        stats = writer.close()
    assert stats.dropped == 900 and stats.written >= 101
    assert any("dropped 900 records" in m for m in caplog.messages)
    events = [decode(line) for line in lines(tmp_path / "n2", RecordType.EVENTS)]
    drops = [e for e in events if isinstance(e, EventRecord) and e.type is EventType.LOG_DROP]
    assert sum(int(e.detail["dropped"]) for e in drops) == 900  # type: ignore[arg-type]


def test_write_never_waits_for_the_disk(tmp_path: Path, blocked_sink: threading.Event) -> None:
    """With the writer thread stuck in I/O, 100k writes from two threads still return."""
    config = LogWriterConfig(buffer_records=1_000)
    writer = LogWriter(tmp_path, "n0", config).start()
    writer.write(latency(0))
    assert blocked_sink.entered.wait(DEADLINE_S)  # type: ignore[attr-defined]
    slowest = [0.0, 0.0]

    def hammer(slot: int) -> None:
        for i in range(50_000):
            started = time.perf_counter()
            writer.write(latency(i))
            slowest[slot] = max(slowest[slot], time.perf_counter() - started)

    threads = [threading.Thread(target=hammer, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "write() blocked while the disk was stuck"
    stats = writer.stats()
    assert stats.accepted + stats.dropped == 100_001
    assert stats.dropped >= 100_001 - 1_000 - 2  # bounded, give or take a racing thread each
    assert max(slowest) < 1.0
    blocked_sink.set()
    writer.close()


def test_sampling_is_deterministic_per_message(tmp_path: Path) -> None:
    config = LogWriterConfig(sample_rate=0.25)
    kept_by: list[set[str]] = []
    for node in ("n0", "n1"):
        with LogWriter(tmp_path, node, config) as writer:
            for i in range(4_000):
                writer.write(latency(i))
            writer.write(EventRecord(1, node, EventType.LEADER_CHANGE, {"term": 1}))
        kept = {decode(x).msg_id for x in lines(tmp_path / node, RecordType.LATENCY)}  # type: ignore[union-attr]
        kept_by.append(kept)
        assert writer.stats().sampled_out == 4_000 - len(kept)
        assert len(lines(tmp_path / node, RecordType.EVENTS)) == 1  # events are never sampled
    assert kept_by[0] == kept_by[1]
    assert 800 < len(kept_by[0]) < 1_200
    assert all(keep_sample(f"M{i:08d}", 1.0) for i in range(100))
    assert not any(keep_sample(i, 0.0) for i in range(100))


def test_switched_off_writes_nothing(tmp_path: Path) -> None:
    with LogWriter(tmp_path, "n0", LogWriterConfig(enabled=False)) as writer:
        assert not writer.write(latency(1))
    assert not (tmp_path / "n0").exists()


def test_close_drains_everything_buffered(tmp_path: Path) -> None:
    config = LogWriterConfig(flush_interval_ms=60_000, drain_interval_ms=60_000)
    writer = LogWriter(tmp_path, "n0", config).start()
    for i in range(5_000):
        writer.write(latency(i))
    stats = writer.close()
    assert stats.written == 5_000
    assert len(lines(tmp_path / "n0", RecordType.LATENCY)) == 5_000
    assert not writer.write(latency(9))  # closed: refused, not buffered forever


def test_write_errors_are_counted_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: logwriter.RotatingFile, batch: list[bytes]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(logwriter.RotatingFile, "write", broken)
    with (
        caplog.at_level(logging.ERROR, logger="chronomq.logwriter"),
        LogWriter(tmp_path, "n0") as writer,
    ):
        for i in range(10):
            writer.write(latency(i))
    assert writer.stats().write_errors == 10
    assert any("No space left" in m for m in caplog.messages)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"buffer_records": 0}, "buffer_records"),
        ({"rotate_bytes": 10}, "rotate_bytes"),
        ({"flush_interval_ms": 0}, "flush_interval_ms"),
        ({"drain_interval_ms": 5_000}, "drain_interval_ms"),
    ],
)
def test_bad_config_names_the_key(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LogWriterConfig(**kwargs)  # type: ignore[arg-type]


def test_node_must_be_a_plain_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        LogWriter(tmp_path, "../n0")


def latency_line(i: int) -> bytes:
    return encode(latency(i))


def test_write_rows_renders_on_the_writer_thread(tmp_path: Path) -> None:
    rendered_on: set[str] = set()

    def render(i: int) -> bytes:
        rendered_on.add(threading.current_thread().name)
        return latency_line(i)

    with LogWriter(tmp_path, "n0") as writer:
        assert writer.write_rows(RecordType.LATENCY, range(0, 500), render)
        assert writer.write_rows(RecordType.LATENCY, [500, 501], render)
        assert not writer.write_rows(RecordType.LATENCY, [], render)
    assert rendered_on == {"logwriter-n0"}
    stats = writer.stats()
    assert stats.accepted == stats.written == 502 and stats.dropped == 0
    got = [decode(x) for x in lines(tmp_path / "n0", RecordType.LATENCY)]
    assert got == [latency(i) for i in range(502)]


def test_write_rows_are_bounded_and_dropped_together(
    tmp_path: Path, blocked_sink: threading.Event
) -> None:
    writer = LogWriter(tmp_path, "n0", LogWriterConfig(buffer_records=100)).start()
    writer.write(latency(0))
    assert blocked_sink.entered.wait(DEADLINE_S)  # type: ignore[attr-defined]
    assert writer.write_rows(RecordType.LATENCY, range(1, 61), latency_line)
    assert not writer.write_rows(RecordType.LATENCY, range(61, 111), latency_line)  # 60 + 50 > 100
    assert writer.write_rows(RecordType.LATENCY, range(111, 151), latency_line)
    assert not writer.write(latency(999))
    assert writer.buffered == 100
    assert writer.stats().dropped == 51
    blocked_sink.set()
    stats = writer.close()
    assert stats.dropped == 51 and writer.buffered == 0
    assert len(lines(tmp_path / "n0", RecordType.LATENCY)) == 101
    assert stats.written == 101 + 1  # and the log_drop event


def test_write_rows_sample_like_write(tmp_path: Path) -> None:
    config = LogWriterConfig(sample_rate=0.3)
    with LogWriter(tmp_path, "rows", config) as by_rows, LogWriter(tmp_path, "one", config) as one:
        by_rows.write_rows(RecordType.LATENCY, range(3_000), latency_line, lambda i: f"M{i:08d}")
        for i in range(3_000):
            one.write(latency(i))
    kept = [lines(tmp_path / n, RecordType.LATENCY) for n in ("rows", "one")]
    assert kept[0] == kept[1] and 600 < len(kept[0]) < 1_200
    rows, single = by_rows.stats(), one.stats()
    assert rows.sampled_out == single.sampled_out == 3_000 - len(kept[0])
    assert rows.accepted == rows.written == len(kept[0])


def test_a_row_or_record_that_cannot_be_written_is_counted_not_fatal(tmp_path: Path) -> None:
    def render(i: int) -> bytes:
        if i == 3:
            raise KeyError("bad row")
        return latency_line(i)

    with LogWriter(tmp_path, "n0") as writer:
        writer.write_rows(RecordType.LATENCY, range(6), render)
        writer.write(EventRecord(1, "n0", EventType.SERVICE_START, {"x": {1, 2}}))  # type: ignore[dict-item]
        writer.write(latency(6))
    stats = writer.stats()
    assert stats.write_errors == 2 and stats.written == 6
    assert len(lines(tmp_path / "n0", RecordType.LATENCY)) == 6


def test_reconfigure_switches_off_and_on(tmp_path: Path) -> None:
    with LogWriter(tmp_path, "n0", LogWriterConfig(enabled=False)) as writer:
        assert not writer.write(latency(0))
        assert writer.reconfigure(enabled=True, sample_rate=1.0).enabled
        assert writer.write(latency(1))
        writer.reconfigure(enabled=False)
        assert not writer.write_rows(RecordType.LATENCY, [2], latency_line)
    assert [decode(x) for x in lines(tmp_path / "n0", RecordType.LATENCY)] == [latency(1)]
