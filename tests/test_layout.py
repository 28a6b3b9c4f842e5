"""The house rules of the source tree (docs/architecture.md 2.2): every folder's README names each of its files, and
imports run one way, commands -> actors -> logic -> base, with no cycles between packages of one layer."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folders and the package each installs as (pyproject.toml's package-dir)
SOURCE_ROOTS = {"swectl": "swectl", "actors": "swectl.actors", "remote": "swectl.remote"}
DOCUMENTED_ROOTS = (*SOURCE_ROOTS, "tests", "benchmarks", "experiments", "examples", "scripts")
SKIPPED_DIRS = {"__pycache__", "results", ".pytest_cache"}
# Folders of task data (Harbor task folders: their own layout, named by the README above them), not of code
DATA_DIRS = ("swectl/data/bundled/harbor",)

# The layers, lowest first. A module may import its own layer's packages and those of lower layers.
BASE = "base"
LAYERS = {
    BASE: {"swectl.config", "swectl.errors", "swectl.schema", "swectl.sandbox", "swectl.logs"},
    "logic": {"swectl.agent", "swectl.engine", "swectl.grading", "swectl.tasks", "swectl.images", "swectl.model",
              "swectl.rl", "swectl.data", "swectl.gateway", "swectl.remote.nodes", "swectl.remote.programs",
              "swectl.testing"},
    "actors": {"swectl.actors"},
    "commands": {"swectl.cli", "swectl.eval", "swectl.serve", "swectl.synth", "swectl.train",
                 "swectl.view"},
}
LAYER_ORDER = list(LAYERS)
# test infrastructure: the product never imports it
TEST_ONLY = "swectl.testing"


def _folders() -> Iterator[Path]:
    for top in DOCUMENTED_ROOTS:
        for folder in [ROOT / top, *sorted((ROOT / top).rglob("*"))]:
            rel = folder.relative_to(ROOT)
            if any(str(rel).startswith(d + "/") for d in DATA_DIRS):
                continue
            if folder.is_dir() and not SKIPPED_DIRS & set(rel.parts):
                yield folder


def _entries(folder: Path) -> list[str]:
    """What a folder's README must name: its modules and files (not __init__.py or README.md) and subfolders."""
    names = []
    for entry in sorted(folder.iterdir()):
        if entry.name in {"__init__.py", "README.md", "conftest.py"} or entry.name in SKIPPED_DIRS:
            continue
        if entry.name.startswith(".") or entry.suffix == ".pyc":
            continue
        names.append(entry.name + "/" if entry.is_dir() else entry.name)
    return names


@pytest.mark.parametrize("folder", list(_folders()), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_folder_has_a_readme_naming_each_file(folder: Path) -> None:
    readme = folder / "README.md"
    assert readme.is_file(), f"{folder.relative_to(ROOT)} has no README.md (one line per file)"
    text = readme.read_text()
    named = set(re.findall(r"`([^`\s]+)`", text))
    missing = [name for name in _entries(folder) if name not in named and name.rstrip("/") not in named]
    assert not missing, f"{readme.relative_to(ROOT)} does not name: {', '.join(missing)}"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    package = SOURCE_ROOTS[rel.parts[0]]
    parts = [*package.split("."), *rel.parts[1:-1]]
    if path.name != "__init__.py":
        parts.append(path.stem)
    return ".".join(parts)


def _package_of(module: str) -> str | None:
    """The layered unit a module belongs to: a base module itself, else its subpackage."""
    for units in LAYERS.values():
        for unit in units:
            if module == unit or module.startswith(unit + "."):
                return unit
    return None


def _layer_of(unit: str) -> str:
    return next(layer for layer, units in LAYERS.items() if unit in units)


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            for alias in node.names:  # `from swectl import remote` names a package
                yield node.lineno, f"{node.module}.{alias.name}"


def _source_files() -> list[Path]:
    files = []
    for top in SOURCE_ROOTS:
        files += [p for p in sorted((ROOT / top).rglob("*.py")) if "__pycache__" not in p.parts]
    return files


def _edges() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, where) for every import between two different layered units."""
    edges = []
    for path in _source_files():
        unit = _package_of(_module_name(path))
        if unit is None:  # the namespace packages swectl and swectl.remote (test_every_source_module_has_a_layer)
            continue
        for line, target in _imports(path):
            if not target.startswith("swectl."):
                continue
            other = _package_of(target)
            if other is not None and other != unit:
                edges.append((unit, other, f"{path.relative_to(ROOT)}:{line} imports {target}"))
    return edges


def test_every_source_module_has_a_layer() -> None:
    unplaced = [str(p.relative_to(ROOT)) for p in _source_files()
                if p.name != "__init__.py" and _package_of(_module_name(p)) is None]
    assert not unplaced, f"modules outside every layer (add them to a package in LAYERS): {unplaced}"


def test_imports_run_downward() -> None:
    upward = [where for unit, other, where in _edges()
              if LAYER_ORDER.index(_layer_of(other)) > LAYER_ORDER.index(_layer_of(unit))]
    assert not upward, "imports against the layers (commands -> actors -> logic -> base):\n" + "\n".join(upward)


def test_base_modules_import_only_base() -> None:
    wrong = [where for unit, other, where in _edges() if _layer_of(unit) == BASE and _layer_of(other) != BASE]
    assert not wrong, "\n".join(wrong)


def test_product_never_imports_test_infrastructure() -> None:
    wrong = [where for unit, other, where in _edges() if other == TEST_ONLY]
    assert not wrong, "\n".join(wrong)


def test_no_cycles_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for unit, other, _ in _edges():
        graph.setdefault(unit, set()).add(other)
    seen: set[str] = set()
    stack: list[str] = []

    def visit(unit: str) -> None:
        if unit in stack:
            cycle = [*stack[stack.index(unit):], unit]
            pytest.fail("import cycle between packages: " + " -> ".join(cycle))
        if unit in seen:
            return
        stack.append(unit)
        for other in sorted(graph.get(unit, ())):
            visit(other)
        stack.pop()
        seen.add(unit)

    for unit in sorted(graph):
        visit(unit)


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The layer check can fail: an actor importing a command module is an upward edge."""
    fake = tmp_path / "fake.py"
    fake.write_text("from swectl.cli.main import main\n")
    assert [t for _, t in _imports(fake)] == ["swectl.cli.main", "swectl.cli.main.main"]
    assert _layer_of(_package_of("swectl.cli.main")) == "commands"
    assert LAYER_ORDER.index("commands") > LAYER_ORDER.index(_layer_of(_package_of("swectl.actors.grader")))


def test_nothing_imports_the_experiments() -> None:
    """experiments/ (research runs with their controls) import swectl and the benchmarks' helpers; the product, the
    benchmarks and the scripts never import an experiment (issue 57: the lab lives beside the product)."""
    experiments = {p.stem for p in (ROOT / "experiments").glob("*.py")}
    assert {"learn", "prm", "probe_update"} <= experiments
    wrong = []
    for top in (*SOURCE_ROOTS, "benchmarks", "scripts"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for line, target in _imports(path):
                if target.split(".")[0] in {"experiments", *experiments}:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)
