"""Harbor (PyPI `harbor` 0.25.0, unmodified, in .venv-harbor from `bash scripts/setup.sh --with-harnesses`) as the
tests run it: its interpreter, and its ATIF validator on a file."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def harbor_python() -> Path:
    """Harbor's interpreter; an AssertionError saying how to install it when it is not there (never a skip: CI
    installs it)."""
    venv = Path(os.environ.get("SWECTL_HARBOR_VENV", REPO_ROOT / ".venv-harbor"))
    python = venv / "bin" / "python"
    assert python.is_file(), f"{python} is missing: run `bash scripts/setup.sh --with-harnesses` (installs Harbor)"
    return python


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
