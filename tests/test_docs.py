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
