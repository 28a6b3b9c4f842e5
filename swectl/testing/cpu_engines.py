"""A CPU engine server (remote/programs/cpu_engine.py) as a local subprocess, for tests and benchmarks that talk
to it over HTTP without the Engines actor."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 120.0


@dataclass
class CpuEngineProcess:
    """A running engine server: its process, base URL and log file; ``stop`` ends it."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def start_cpu_engine(model: Path, log: Path, *args: str, cwd: Path | None = None,
                     timeout_s: float = START_TIMEOUT_S) -> CpuEngineProcess:
    """``python -m swectl.remote.programs.cpu_engine --model MODEL --port 0 ARGS``, its output in ``log``; the URL
    comes from its ``ready on`` line. RuntimeError with the log's tail if it exits or is not ready in time."""
    argv = [sys.executable, "-m", "swectl.remote.programs.cpu_engine", "--model", str(model), "--port", "0", *args]
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=cwd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        found = re.search(r"ready on (http://\S+)", log.read_text(errors="replace"))
        if found:
            return CpuEngineProcess(proc, found.group(1), log)
        time.sleep(0.05)
    CpuEngineProcess(proc, "", log).stop()
    raise RuntimeError(f"the CPU engine did not start: {log.read_text(errors='replace')[-3000:]}")
