"""Fixtures shared by the unit tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from swectl.tasks import specs as specs_mod
from swectl.tasks.specs import SpecTable, load_specs

FETCH = Path(__file__).resolve().parents[1] / "scripts" / "fetch_swebench_specs.sh"


@pytest.fixture(scope="session")
def specs() -> SpecTable:
    """The real SWE-bench 4.1.0 table; runs the fetch script (needs PyPI) only when no specs file is in place."""
    if not any(p.is_file() for p in specs_mod.default_spec_paths()):
        done = subprocess.run(["bash", str(FETCH)], capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            pytest.skip(f"fetch_swebench_specs.sh failed (offline?): {done.stderr[-500:]}")
    return load_specs()
