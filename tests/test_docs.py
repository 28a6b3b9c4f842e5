"""The user documentation cannot drift: docs/config.md is what scripts/config_doc.py generates from the config
Structs, the README stays one or two screens, and every relative link in the README and docs/ resolves."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_config_reference_matches_the_config() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from config_doc import render

    assert (ROOT / "docs" / "config.md").read_text() == render(), \
        "docs/config.md is stale: run .venv/bin/python scripts/config_doc.py --write"


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


# a bench's result file; quick runs (NAME.quick.json) are scratch output the ignore rules keep out of git by design
RESULT_FILE = re.compile(r"(?:benchmarks/)?results/([a-z0-9_]+\.json)")
# measured once and cited, but the file of that run never reached git (an untracked file beside an ignore rule's
# exception is not added by `git commit -a`); the pages citing them say so, and a rerun of the bench restores them
LOST_RESULTS: set[str] = set()  # chaos.json was one, until its rerun of 2026-12-07


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
                                  *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_result_file_is_in_the_tree(page: Path) -> None:
    """A result the docs cite is a file a clean clone has (and not one the ignore rules would keep out of git)."""
    text = page.read_text()
    missing = sorted({name for name in RESULT_FILE.findall(text)
                      if name not in LOST_RESULTS and not (ROOT / "benchmarks" / "results" / name).exists()})
    assert not missing, f"{page.relative_to(ROOT)} cites results missing from benchmarks/results/: {missing}"
    for name in LOST_RESULTS & set(RESULT_FILE.findall(text)):
        assert "never reached git" in text, f"{page.relative_to(ROOT)} cites the lost {name} without saying so"


def test_every_result_file_is_tracked() -> None:
    """Every benchmarks/results/*.json on disk is one git tracks: a bench's output is evidence, the ignore rules keep
    only named files (a new bench's result needs its `!` line in .gitignore), and `git commit -a` adds no new file
    (how three results of 2026-12-02 were lost)."""
    import subprocess

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks" / "results").glob("*.json")}
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *sorted(on_disk)], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    kept_out = sorted(p for p in ignored if not p.endswith(".quick.json"))  # scratch output (RESULT_FILE)
    assert not kept_out, f"ignored by .gitignore, so never committed: {kept_out}"
    tracked = set(subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True,
                                 text=True).stdout.split())
    untracked = sorted(p for p in on_disk - tracked if not p.endswith(".quick.json"))
    assert not untracked, f"not in git yet (`git add` them: `git commit -a` does not): {untracked}"
