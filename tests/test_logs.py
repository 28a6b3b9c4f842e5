"""swectl/logs.py: records of ``swectl.*`` loggers reach stderr by verbosity and a run's swectl.log; nothing is
left attached when a command ends. The event is a real one: a malformed task row skipped by the loader."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from swectl import logs
from swectl.cli.main import build_parser
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.sources import load_tasks


def _swectl_handlers() -> list[logging.Handler]:
    return list(logging.getLogger(logs.ROOT).handlers)


def test_a_skipped_row_reaches_the_run_log_and_nothing_stays_attached(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "tasks.jsonl"
    good = BUNDLED_TASKS.read_text().splitlines()[0]
    source.write_text(good + "\n{not json\n")
    before = _swectl_handlers()
    with logs.configure(0):
        path = logs.write_run_log(tmp_path / "run")
        assert logs.write_run_log(tmp_path / "run") == path  # the same folder is not added twice
        loaded = load_tasks(source)
    assert len(loaded.tasks) == 1
    assert len(loaded.problems) == 1
    text = path.read_text()
    assert text.count("skipped row") == 1, text
    assert f"INFO swectl.tasks.sources: skipped row {source}:2" in text, text
    assert "skipped row" not in capsys.readouterr().err  # info is for -v; the command says it itself
    assert _swectl_handlers() == before
    load_tasks(source)  # after the command: the file is closed and gets nothing more
    assert path.read_text() == text


@pytest.mark.parametrize(("verbosity", "shown", "hidden"), [
    (-1, ["error"], ["warning", "info"]),
    (0, ["error", "warning"], ["info"]),
    (1, ["error", "warning", "info"], ["debug"]),
    (2, ["error", "warning", "info", "debug"], []),
])
def test_verbosity_picks_what_reaches_the_terminal(verbosity: int, shown: list[str], hidden: list[str],
                                                   tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = logging.getLogger("swectl.actors.test")
    with logs.configure(verbosity):
        path = logs.write_run_log(tmp_path)
        for level in ("debug", "info", "warning", "error"):
            getattr(log, level)("%s event", level)
    err = capsys.readouterr().err
    for level in shown:
        assert f"{level} event" in err, err
    for level in hidden:
        assert f"{level} event" not in err, err
    assert "swectl: warning: warning event" in err or verbosity < 0
    assert "swectl: info event" in err or verbosity < 1
    in_file = path.read_text()
    assert "info event" in in_file and "error event" in in_file  # the run log has info and up at any verbosity
    assert ("debug event" in in_file) == (verbosity >= 2)


def test_verbosity_flags_are_global() -> None:
    parser = build_parser()
    assert parser.parse_args(["-vv", "check-config", "x.toml"]).verbose == 2
    assert parser.parse_args(["-q", "check-config", "x.toml"]).quiet
    with pytest.raises(SystemExit):
        parser.parse_args(["-q", "-v", "check-config", "x.toml"])


def test_a_command_run_inside_the_process_closes_the_run_files_it_opened(tmp_path: Path) -> None:
    """A recipe's phase runs inside the `swectl up` process: the swectl.log it opened is closed when it ends, so the
    next phase's records do not land in it; a run file opened before the phase stays."""
    with logs.configure(0):
        logs.write_run_log(tmp_path / "outer")
        with logs.run_files_scope():
            logs.write_run_log(tmp_path / "phase")
            logging.getLogger("swectl.test").warning("inside the phase")
        logging.getLogger("swectl.test").warning("after the phase")
        files = [Path(h.baseFilename).parent.name for h in _swectl_handlers() if isinstance(h, logging.FileHandler)]
        assert files == ["outer"]
    phase = (tmp_path / "phase" / logs.RUN_LOG).read_text()
    assert "inside the phase" in phase and "after the phase" not in phase
    assert "after the phase" in (tmp_path / "outer" / logs.RUN_LOG).read_text()
    assert not [h for h in _swectl_handlers() if isinstance(h, logging.FileHandler)]
