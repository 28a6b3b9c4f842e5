"""Every way a command is stopped from outside (swectl/cli/main.py): Ctrl-C (SIGINT), ``kill`` (SIGTERM) and a
closed terminal (SIGHUP) stop `swectl model init` cleanly, with exit 130 and a message true for it; a signal
the process inherited as ignored (``nohup``) stays ignored. Containers on SIGTERM: tests/integration/
test_eval_model.py.

The child's SIGINT disposition is set explicitly (``preexec_fn``): a suite started from a background job
inherits SIGINT ignored, and the test must hold there too."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

for _module in ("torch", "transformers", "tokenizers", "safetensors"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install 'swectl[cpu]')")

SMALL = ["--vocab", "1024", "--hidden", "64", "--layers", "2", "--corpus-max-bytes", "2000000"]


def _start(out: Path, *, sigint: signal.Handlers, sighup: signal.Handlers = signal.SIG_DFL) -> subprocess.Popen[str]:
    def dispositions() -> None:  # in the child, before exec
        signal.signal(signal.SIGINT, sigint)
        signal.signal(signal.SIGHUP, sighup)

    return subprocess.Popen([sys.executable, "-m", "swectl.cli.main", "model", "init", "--out", str(out), *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=dispositions)


def _wait_for_work(run: subprocess.Popen[str]) -> list[str]:
    """Read stderr until the tokenizer starts training (seconds before anything is saved)."""
    assert run.stderr is not None
    seen = []
    for line in run.stderr:
        seen.append(line)
        if "tokenizer corpus:" in line:
            return seen
    pytest.fail(f"model init ended before it started work: {''.join(seen)}")


@pytest.mark.parametrize(("sig", "sigint"), [
    (signal.SIGINT, signal.SIG_DFL),
    (signal.SIGTERM, signal.SIG_DFL),
    (signal.SIGTERM, signal.SIG_IGN),  # a background job: SIGINT ignored, SIGTERM still stops it cleanly
    (signal.SIGHUP, signal.SIG_DFL),
], ids=["SIGINT", "SIGTERM", "SIGTERM-in-background-job", "SIGHUP"])
def test_a_signal_stops_model_init_cleanly(sig: signal.Signals, sigint: signal.Handlers, tmp_path: Path) -> None:
    out = tmp_path / "model"
    run = _start(out, sigint=sigint)
    _wait_for_work(run)
    run.send_signal(sig)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err
    assert "swectl: interrupted; the model folder is moved into place only when complete" in err, err
    assert "Traceback" not in err, err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # nor its staging folder


def test_an_ignored_sighup_stays_ignored(tmp_path: Path) -> None:
    """Under ``nohup`` a closed terminal must not stop the command."""
    out = tmp_path / "model"
    run = _start(out, sigint=signal.SIG_DFL, sighup=signal.SIG_IGN)
    _wait_for_work(run)
    run.send_signal(signal.SIGHUP)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 0, err
    assert (out / "config.json").is_file()
