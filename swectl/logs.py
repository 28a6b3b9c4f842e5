"""Where swectl's log records go: the terminal (stderr, by verbosity) and a run's ``swectl.log``.

Modules log what happens inside a run (an engine restarted, a node lost or back, a retry, orphans reaped, a
task row skipped) with ``logging.getLogger(__name__)``; every such logger sits under ``swectl`` (actors and
remote are installed as ``swectl.actors`` and ``swectl.remote``). Progress lines are not log records: the
commands print them (``swectl.cli.common.say``).

``configure(verbosity)`` wraps one command (``swectl.cli.main``); ``write_run_log(folder)`` adds the run's
file once the command knows its output folder. Both only attach handlers to the ``swectl`` logger, and
``configure`` takes off everything it or ``write_run_log`` attached when the command ends, so two commands in
one process (tests) do not share a file or print twice. There is no state beyond stdlib logging's own.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = "swectl"
RUN_LOG = "swectl.log"
# -q, (none), -v, -vv: what reaches the terminal
_TERMINAL_LEVELS = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}
_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _TerminalFormatter(logging.Formatter):
    """``swectl: warning: <message>`` beside the progress lines (``swectl: <message>`` for info)."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        text = f"swectl: {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _RunFile(logging.FileHandler):
    """A run's swectl.log; the type marks the handlers ``configure`` takes off at the end."""


def _terminal_level(verbosity: int) -> int:
    return _TERMINAL_LEVELS[max(-1, min(2, verbosity))]


@contextmanager
def configure(verbosity: int = 0) -> Iterator[None]:
    """Log records of ``swectl.*`` to stderr at the level ``verbosity`` picks (-1 errors only, 0 warnings,
    1 info, 2 debug) while the block runs; run files added meanwhile are closed when it ends."""
    logger = logging.getLogger(ROOT)
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setLevel(_terminal_level(verbosity))
    terminal.setFormatter(_TerminalFormatter())
    saved = logger.level, logger.propagate
    logger.setLevel(logging.DEBUG if verbosity >= 2 else logging.INFO)
    logger.propagate = False  # the terminal handler is the one place records are printed
    logger.addHandler(terminal)
    try:
        yield
    finally:
        logger.removeHandler(terminal)
        for handler in [h for h in logger.handlers if isinstance(h, _RunFile)]:
            logger.removeHandler(handler)
            handler.close()
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@contextmanager
def run_files_scope() -> Iterator[None]:
    """Run files (``write_run_log``) added while the block runs are closed when it ends: a command run inside this
    process (a first-run phase) leaves no swectl.log open that would go on taking the next phase's records."""
    logger = logging.getLogger(ROOT)
    before = {id(handler) for handler in logger.handlers}
    try:
        yield
    finally:
        for handler in [h for h in logger.handlers if isinstance(h, _RunFile) and id(h) not in before]:
            logger.removeHandler(handler)
            handler.close()


def write_run_log(folder: str | Path) -> Path:
    """Append ``swectl.*`` records (info and up) to ``folder/swectl.log`` from now on; returns the path.

    Inside ``configure`` the file is closed when the command ends; a folder already being written is not
    added twice."""
    path = Path(folder) / RUN_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(ROOT)
    for handler in logger.handlers:
        if isinstance(handler, _RunFile) and Path(handler.baseFilename) == path.resolve():
            return path
    handler = _RunFile(path, encoding="utf-8")
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(_FILE_FORMAT))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return path
