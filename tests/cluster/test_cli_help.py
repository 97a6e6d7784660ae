"""Every ``chronomq`` command's --help is complete: a summary, a description, every option
explained, and at least one example of that very command in the epilog."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from chronomq.cli import build_parser, main


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = (), summary: str | None = "(top)"
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str | None]]:
    """Every parser of the tree, with its path and the help its parent lists it with."""
    yield path, parser, summary
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                yield from commands(child, (*path, name), listed.get(name))


def problems(parser: argparse.ArgumentParser) -> list[str]:
    """What is missing from each command's help, one line per gap."""
    found = []
    for path, sub, summary in commands(parser):
        name = " ".join(("chronomq", *path))
        if not summary:
            found.append(f"{name}: no help line in its parent's list of commands")
        if path and not (sub.description or "").strip():
            found.append(f"{name}: no description")
        example = re.compile(rf"^\s+(sudo\s+)?{re.escape(name)}(\s|$)", re.M)
        if not example.search(sub.epilog or ""):
            found.append(f"{name}: no example of `{name} ...` in its epilog")
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if not action.help:
                found.append(f"{name}: {action.dest} has no help")
        try:
            sub.format_help()  # a stray % in a help text only fails here
        except (ValueError, TypeError, KeyError) as exc:
            found.append(f"{name}: --help fails: {exc}")
    return found


def test_the_tree_covers_every_command() -> None:
    paths = {" ".join(path) for path, _, _ in commands(build_parser())}
    expected = {
        "cluster up",
        "timer cancel",
        "timer status",
        "bench produce",
        "bench schedule",
        "bench timer",
        "bench grpc",
        "bench models",
        "config",
        "api",
        "drill",
        "report",
        "logs synth",
    }
    assert expected <= paths, expected - paths


def test_every_command_has_help_a_description_and_an_example() -> None:
    assert problems(build_parser()) == []


def test_a_command_without_an_example_is_found() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bare = sub.add_parser("shiny", help="a new command", description="Does new things.")
    bare.add_argument("--knob")
    assert problems(parser) == [
        "chronomq shiny: no example of `chronomq shiny ...` in its epilog",
        "chronomq shiny: knob has no help",
    ]


@pytest.mark.parametrize(
    "argv",
    [[], ["cluster", "up"], ["timer", "cancel"], ["bench", "schedule"], ["api"], ["drill"]],
)
def test_help_prints_examples(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "example" in out and " ".join(("chronomq", *argv)) in out
