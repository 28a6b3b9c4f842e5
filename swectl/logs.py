"""Where swectl's log records go: the terminal (stderr, by verbosity) and a run's ``swectl.log``.

Modules log what happens inside a run (an engine restarted, a node lost or back, a retry, orphans reaped, a
task row skipped) with ``logging.getLogger(__name__)``; every such logger sits under ``swectl`` (actors and
remote are installed as ``swectl.actors`` and ``swectl.remote``). Progress lines are not log records: the
commands print them (``swectl.cli.common.say``).

``configure(verbosity)`` wraps one command (``swectl.cli.main``); ``write_run_log(folder)`` adds the run's
file once the command knows its output folder. Both only attach handlers to the ``swectl`` logger, and
``configure`` takes off everything it or ``write_run_log`` attached when the command ends, so two commands in
one process (tests) do not share a file or print twice.

Several commands can run at once in one event loop (a recipe's sibling phases, swectl/train/recipe.py). Each runs
in a ``run_files_scope``: the run files it adds take the records logged inside that scope only (the scope is a
context variable, which every task and worker thread started inside inherits), and ``output_to(stream)`` sends what
the command prints (``out()``, ``err()``: progress lines, results, terminal log records) to a file of its own
instead of the terminal. There is no state beyond stdlib logging's own and these context variables.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TextIO

ROOT = "swectl"
RUN_LOG = "swectl.log"
# -q, (none), -v, -vv: what reaches the terminal
_TERMINAL_LEVELS = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}
_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# where the running command's printed output goes (None: the terminal's stdout and stderr)
_OUTPUT: ContextVar[TextIO | None] = ContextVar("swectl_output", default=None)
# the run-files scopes the running code is inside, outermost first (each an object of its own)
_SCOPES: ContextVar[tuple[object, ...]] = ContextVar("swectl_run_file_scopes", default=())


def out() -> TextIO:
    """Where the running command prints its results: stdout, or the stream ``output_to`` gave it."""
    return _OUTPUT.get() or sys.stdout


def err() -> TextIO:
    """Where the running command prints progress and status lines: stderr, or the stream ``output_to`` gave it."""
    return _OUTPUT.get() or sys.stderr


@contextmanager
def output_to(stream: TextIO) -> Iterator[None]:
    """What the code inside the block prints through ``out()`` and ``err()`` (and its terminal log records) goes to
    ``stream``: a command that runs beside another keeps the terminal for that one."""
    token = _OUTPUT.set(stream)
    try:
        yield
    finally:
        _OUTPUT.reset(token)


class _TerminalFormatter(logging.Formatter):
    """``swectl: warning: <message>`` beside the progress lines (``swectl: <message>`` for info)."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        text = f"swectl: {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _RunFile(logging.FileHandler):
    """A run's swectl.log; the type marks the handlers ``configure`` takes off at the end. It takes the records
    logged inside the run-files scope it was added in (``scopes``), and inside scopes opened within that one."""

    def __init__(self, path: Path, scopes: tuple[object, ...]) -> None:
        super().__init__(path, encoding="utf-8")
        self.scopes = scopes
        self.addFilter(lambda record: _SCOPES.get()[:len(self.scopes)] == self.scopes)


class _Terminal(logging.StreamHandler):  # type: ignore[type-arg]
    """Log records on the running command's ``err()`` stream (stderr unless ``output_to`` says otherwise)."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return err()

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler sets it; the stream is looked up per record
        pass


def _terminal_level(verbosity: int) -> int:
    return _TERMINAL_LEVELS[max(-1, min(2, verbosity))]


@contextmanager
def configure(verbosity: int = 0) -> Iterator[None]:
    """Log records of ``swectl.*`` to stderr at the level ``verbosity`` picks (-1 errors only, 0 warnings,
    1 info, 2 debug) while the block runs; run files added meanwhile are closed when it ends."""
    logger = logging.getLogger(ROOT)
    terminal = _Terminal()
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
    """A scope for run files: those ``write_run_log`` adds inside the block take only the records logged inside it
    (a sibling phase's records stay out of this phase's swectl.log), and are closed when it ends, so a command run
    inside this process (a recipe's phase) leaves no swectl.log open that would go on taking the next one's."""
    logger = logging.getLogger(ROOT)
    scopes = (*_SCOPES.get(), object())
    token = _SCOPES.set(scopes)
    try:
        yield
    finally:
        _SCOPES.reset(token)
        for handler in [h for h in logger.handlers if isinstance(h, _RunFile) and h.scopes == scopes]:
            logger.removeHandler(handler)
            handler.close()


def write_run_log(folder: str | Path) -> Path:
    """Append ``swectl.*`` records (info and up) to ``folder/swectl.log`` from now on; returns the path.

    Inside ``configure`` the file is closed when the command ends; a folder already being written is not
    added twice."""
    path = Path(folder) / RUN_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger(ROOT)
    scopes = _SCOPES.get()
    for handler in logger.handlers:
        if isinstance(handler, _RunFile) and Path(handler.baseFilename) == path.resolve() and \
                handler.scopes == scopes:
            return path
    handler = _RunFile(path, scopes)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(_FILE_FORMAT))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return path
