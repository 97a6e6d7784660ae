"""The command line: argument handling, bad input without starting Spark, a full local run."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

import pytest

from chronomq.cluster.logs.schema import RecordType, decode
from chronomq.ops.cli import main
from chronomq.ops.report import ReportOptions, report_main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_report(logs: str) -> tuple[int, str]:
    """The report command on input that must be refused before Spark even starts."""
    stream = io.StringIO()
    options = ReportOptions(logs=(logs,), out="/nonexistent/out", master="local[1]")
    return report_main(options, stream), stream.getvalue()


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    code, output = run_report(str(tmp_path / "nope"))
    assert code == 2
    assert output == f"chronomq report: error: log directory not found: {tmp_path / 'nope'}\n"


def test_directory_without_logs_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "n0").mkdir()
    (tmp_path / "n0" / "notes.txt").write_text("hello")
    code, output = run_report(str(tmp_path))
    assert code == 2 and "no chronomq log files under" in output
    assert "latency-000001.jsonl" in output


def test_empty_logs_are_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "n0").mkdir()
    for record_type in RecordType:
        (tmp_path / "n0" / f"{record_type}-000001.jsonl").write_bytes(b"")
    code, output = run_report(str(tmp_path))
    assert code == 2 and "are all empty" in output


def test_file_instead_of_directory(tmp_path: Path) -> None:
    path = tmp_path / "latency-000001.jsonl"
    path.write_text("{}")
    code, output = run_report(str(path))
    assert code == 2 and "not a directory" in output


@pytest.mark.parametrize(
    ("master", "code", "text"),
    [
        ("yarn", 2, "unsupported --master"),
        ("spark://127.0.0.1:{port}", 1, "cannot reach the Spark master"),
        ("sc://127.0.0.1:{port}", 1, "cannot reach the Spark Connect server"),
        ("spark://127.0.0.1:{port},127.0.0.1:{port}", 1, "; 127.0.0.1:"),
        ("spark://127.0.0.1:notaport", 2, "invalid port"),
    ],
)
def test_unusable_master_fails_fast(
    small_logs: tuple[Path, object], tmp_path: Path, master: str, code: int, text: str
) -> None:
    # Free ports are picked here, not at collection: every test process must collect the
    # same test ids.
    while "{port}" in master:
        master = master.replace("{port}", str(free_port()), 1)
    stream = io.StringIO()
    options = ReportOptions(logs=(str(small_logs[0]),), out=str(tmp_path), master=master)
    assert report_main(options, stream) == code
    assert text in stream.getvalue()
    assert "\tat " not in stream.getvalue()


def test_synth_command_writes_logs_and_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "synth"
    assert main(["logs", "synth", "--rows", "2_000", "--out", str(out), "--seed", "3"]) == 0
    figures = json.loads((out / "synth.json").read_text())
    assert figures["latency_rows"] == 2_000
    assert "wrote 2,000 latency" in capsys.readouterr().out
    rows = sum(
        1
        for path in out.glob("n*/latency-*.jsonl")
        for line in path.read_bytes().splitlines()
        if decode(line, RecordType.LATENCY)
    )
    assert rows == 2_000


def test_synth_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["logs", "synth", "--rows", "0", "--out", str(tmp_path)])
    assert caught.value.code == 2
    assert main(["logs", "synth", "--rows", "10", "--nodes", "2", "--out", str(tmp_path)]) == 2
    assert "nodes must be within" in capsys.readouterr().err


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["report", "--help"], ["logs", "synth", "--help"]):
        with pytest.raises(SystemExit) as caught:
            main(argv)
        assert caught.value.code == 0
        assert "examples:" in capsys.readouterr().out
    assert main(["logs"]) == 2
