"""One recipe run through the product's own command, for the suites that measure a recipe (learn_harness, hack,
chaos, and experiments/learn.py, prm.py): `swectl up --recipe R --set out_dir=... --set run_id=... --set ...`, or
`swectl up --resume RUN` when the run folder holds an unfinished run of it, and its summary.json read back.

A suite's controls are recipes too (benchmarks/recipes/, experiments/recipes/, the bundled first-run-control): a
suite says which recipe, which vars and which config keys, and reads the run folder; it does not compose phases.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from swectl.config import toml_value
from swectl.train.recipe import RECIPE_FILE, SUMMARY_FILE, Summary

REPO = Path(__file__).resolve().parents[1]
SWECTL = [sys.executable, "-m", "swectl.cli.main"]


def recipe_file(name: str) -> str:
    """A recipe of the suites' own (benchmarks/recipes/NAME.toml, experiments/recipes/NAME.toml) as a path, or
    ``name`` as it is (a bundled recipe or a FILE)."""
    for folder in ("benchmarks", "experiments"):
        path = REPO / folder / "recipes" / f"{name}.toml"
        if path.is_file():
            return str(path)
    return name


def derived(path: Path, base: str, lines: list[str]) -> str:
    """A recipe file at ``path`` extending ``base`` (a suite's own recipe, a bundled name or a FILE) with ``lines`` of
    TOML (a drop, a phase changed); its path, for `swectl up --recipe`. With no lines, ``base`` itself."""
    if not lines:
        return recipe_file(base)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([f"extends = {toml_value(recipe_file(base))}", *lines]) + "\n")
    return str(path)


def var_sets(vars_: dict[str, Any]) -> list[str]:
    """``recipe.NAME=VALUE`` for each var."""
    return [f"recipe.{key}={toml_value(value)}" for key, value in vars_.items()]


def up_argv(recipe: str, run_dir: Path, sets: list[str]) -> list[str]:
    """The `swectl up` command line of the run: a new run of ``recipe`` in ``run_dir``, or its resume."""
    if (run_dir / RECIPE_FILE).is_file():  # an earlier call's run: its finished phases are kept
        return ["up", "--resume", str(run_dir)]
    where = [f"out_dir={toml_value(str(run_dir.parent))}", f"run_id={toml_value(run_dir.name)}"]
    return ["up", "--recipe", recipe_file(recipe), *[x for s in [*where, *sets] for x in ("--set", s)]]


def run(recipe: str, run_dir: Path, sets: list[str], say: Callable[[str], None]) -> Summary:
    """The recipe run to its end (the finished phases of an earlier call kept); its summary.json. A failed run stops
    the suite with the command's exit code."""
    run_dir = run_dir.resolve()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = up_argv(recipe, run_dir, sets)
    say(f"swectl {' '.join(argv)}")
    code = subprocess.run([*SWECTL, *argv], cwd=REPO, check=False).returncode
    if code != 0:
        raise SystemExit(f"swectl up failed (exit {code}) in {run_dir}; a rerun goes on from its finished phases")
    return read_summary(run_dir)


def read_summary(run_dir: Path) -> Summary:
    return msgspec.json.decode((run_dir / SUMMARY_FILE).read_bytes(), type=Summary)
