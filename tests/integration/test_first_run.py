"""`swectl up` with no config file: the first-run recipe, shrunk by ``--set recipe.*`` to four bundled tasks (two
train, two held out) and a few steps, through every phase with real sandboxes, the CPU engine and torchrun ranks, in
one event loop (the siblings at once): the phase lines, the table (printed and in swectl.log), summary.json,
phases.json, and a resume that finds every phase done."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swectl.images.project import BUNDLED_TASKS
from swectl.train.recipe import load

pytestmark = [pytest.mark.integration]
SHRUNK = {"sft_steps": 3, "sft_warmup": 2, "sft_batch_size": 4, "grpo_steps": 1, "tasks_per_step": 2, "n_samples": 2,
          "eval_samples": 1, "test_samples": 1, "concurrency": 4}


def _up(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "swectl.cli.main", "up", *argv], capture_output=True, text=True,
                          timeout=1200)


def test_the_first_run_goes_through_every_phase_and_ends_with_its_table(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(BUNDLED_TASKS.read_text().splitlines()[:4]) + "\n")
    sets = {**SHRUNK, "tasks": repr(str(tasks))}
    argv = ["--set", f"out_dir={str(tmp_path)!r}", "--set", "run_id='first'", "--set", "trainer.nproc_per_node=1"]
    for key, value in sets.items():
        argv += ["--set", f"recipe.{key}={value}"]
    done = _up(*argv)
    assert done.returncode == 0, done.stderr[-4000:]
    run = tmp_path / "first"
    phases = [p.name for p in load("first-run", {}).file.phase]
    for index, name in enumerate(phases):
        assert f"[{index + 1}/{len(phases)}] {name}:" in done.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["readings"]["sft_train"]["episodes"] == 2 and summary["readings"]["test"]["episodes"] == 2
    readings = summary["readings"]
    assert summary["gain_points"] == pytest.approx(
        100 * (readings["grpo_train"]["resolve_rate"] - readings["sft_train"]["resolve_rate"]), abs=0.06)
    assert set(summary["phases_s"]) == set(phases)
    assert "eval-sft" in (run / "eval-sft.log").read_text()  # the reading beside GRPO printed into its own log
    assert json.loads(done.stdout.strip().splitlines()[-1])["summary"] == str(run / "summary.json")
    log = (run / "swectl.log").read_text()
    assert "train split after GRPO" in done.stderr and "train split after GRPO" in log
    trained = {t for line in (run / "grpo" / "steps.jsonl").read_text().splitlines() for t in json.loads(line)["tasks"]}
    train_split = {json.loads(line)["instance_id"] for line in (run / "train.jsonl").read_text().splitlines()}
    assert trained and trained <= train_split  # GRPO trained on the split the readings call train
    assert json.loads((run / "recipe.json").read_text())["vars"]["sft_steps"] == 3

    again = _up("--resume", str(run))
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"resuming {run}" in again.stderr
    assert "swectl eval" not in again.stderr and "swectl data gold" not in again.stderr  # every phase was kept
    assert json.loads((run / "summary.json").read_text())["readings"] == summary["readings"]
