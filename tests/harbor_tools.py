"""Harbor's ATIF validator and interpreter as the unit tests run them (the rest of Harbor's tooling, shared with
the benchmarks, is swectl/testing/harbor.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from swectl.testing.harbor import harbor_python


def harbor_validates(path: Path) -> tuple[bool, str]:
    """Harbor's own ATIF validator (harbor.utils.trajectory_validator) on ``path``: (valid, its output)."""
    run = subprocess.run([str(harbor_python()), "-m", "harbor.utils.trajectory_validator", str(path)],
                         capture_output=True, text=True, timeout=120, check=False)
    return run.returncode == 0, run.stdout + run.stderr


def run_harbor_python(code: str, *args: str, timeout: float = 120) -> str:
    """Run ``code`` with Harbor's interpreter (``args`` as sys.argv[1:]); its stdout, or an AssertionError with
    its output."""
    run = subprocess.run([str(harbor_python()), "-c", code, *args], capture_output=True, text=True,
                         timeout=timeout, check=False)
    assert run.returncode == 0, f"Harbor's interpreter failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    return run.stdout
