"""The CLI is frozen: every command's and subcommand's ``--help`` must equal ``tests/cli_help.txt``, so a flag
cannot disappear (or change its meaning) by accident.

After a deliberate CLI change, regenerate the file and commit it with the change:

    SWECTL_UPDATE_CLI_SNAPSHOT=1 .venv/bin/python -m pytest tests/test_cli_help.py

The help is formatted 100 columns wide (``COLUMNS``) whatever the terminal, by the Python of ``.venv``
(argparse's layout differs slightly between Python versions).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from swectl.cli.main import build_parser

SNAPSHOT = Path(__file__).with_name("cli_help.txt")
UPDATE = "SWECTL_UPDATE_CLI_SNAPSHOT"
COLUMNS = "100"


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser below it, depth first, in the order they were added."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def render() -> str:
    """Every parser's help, each under a header line naming the command."""
    parts = []
    for parser in _parsers(build_parser()):
        parts.append(f"==== {parser.prog} --help\n{parser.format_help().rstrip()}\n")
    return "\n".join(parts)


def test_every_help_matches_the_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", COLUMNS)  # argparse wraps to the terminal width it reads from here
    text = render()
    if os.environ.get(UPDATE) == "1":
        SNAPSHOT.write_text(text)
        return
    assert SNAPSHOT.is_file(), f"{SNAPSHOT} is missing; create it with {UPDATE}=1 (see this file's docstring)"
    expected = SNAPSHOT.read_text()
    if text != expected:
        import difflib

        diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), text.splitlines(keepends=True),
                                            "tests/cli_help.txt", "swectl now", n=2))
        pytest.fail(f"the CLI changed. If that was meant, regenerate the snapshot with {UPDATE}=1 (see "
                    f"tests/test_cli_help.py) and commit it with the change:\n{diff}", pytrace=False)


def test_the_snapshot_names_every_command() -> None:
    """The walk reaches the leaves: `swectl eval`, `swectl model init`, `swectl nodes check`, ..."""
    progs = [p.prog for p in _parsers(build_parser())]
    assert progs[0] == "swectl"
    for prog in ("swectl eval", "swectl model init", "swectl image build", "swectl data prepare", "swectl up"):
        assert prog in progs, progs
