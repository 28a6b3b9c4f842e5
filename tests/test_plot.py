"""`swectl plot` through ``swectl.cli.main.main`` on metrics.jsonl files written here: one valid PNG per panel
the run has data for, malformed lines reported by file:line and skipped, clear errors (exit 2) otherwise."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from swectl.actors.metrics import Metrics
from swectl.cli.main import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ALL_PANELS = {"reward", "loss", "entropy_kl", "grad_lr", "clipping", "throughput", "eval"}


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    assert data[-8:-4] == b"IEND"


def training_run(run: Path, steps: int = 6) -> None:
    """A run as the controller logs it: a train line per step, an eval line every 3 steps, a NaN on the way."""
    with Metrics(run) as metrics:
        metrics.log(0, {"eval/resolve_rate": 0.0, "eval/episodes": 4.0, "eval/time_s": 12.0})
        for step in range(1, steps + 1):
            metrics.log(step, {
                "reward_mean": step / steps, "resolve_rate": step / (2 * steps), "pass_at_k": 0.5,
                "loss": 1.0 / step if step != 3 else math.nan, "entropy": 2.0 - step / 10, "kl_mean": 0.01 * step,
                "grad_norm": 1.5, "lr": 1e-6 * step, "clip_frac_low": 0.01, "clip_frac_high": 0.02,
                "tis_clip_frac": 0.0, "ratio_mean": 1.0, "ratio_max": 1.3, "tis_mean": 1.0, "tis_max": 2.0,
                "train_tokens_per_s": 1200.0, "rollout_s": 30.0, "train_s": 4.0, "sync_s": 1.0, "step_s": 35.0,
                "weight_version": float(step), "agent/turns_mean": 7.0, "adv/mean": 0.0,
            })
            if step % 3 == 0:
                metrics.log(step, {"eval/resolve_rate": step / 10, "eval/episodes": 4.0, "eval/time_s": 10.0})


def test_plot_draws_every_panel_into_run_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    training_run(run)
    assert main(["plot", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    pngs = sorted((run / "plots").glob("*.png"))
    assert {p.stem for p in pngs} == ALL_PANELS
    assert sorted(Path(line) for line in out) == pngs
    for png in pngs:
        assert_png(png)


def test_plot_draws_only_what_the_run_has_into_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "sft"
    with Metrics(run) as metrics:
        for step in (1, 2, 3):
            metrics.log(step, {"loss": 1.0 / step, "grad_norm": 0.5, "something_else": 3.0,
                               "kl_mean": math.nan, "entropy": "n/a", "lr": True})  # none of these drawn
    out = tmp_path / "figures" / "sft"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["grad_lr.png", "loss.png"]
    assert not (run / "plots").exists()
    for png in out.iterdir():
        assert_png(png)


def test_a_malformed_line_is_reported_with_file_and_line_and_skipped(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    path = run / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n{not json\n" + json.dumps({"step": 2, "loss": 0.5})
                    + "\n" + json.dumps({"loss": 0.1}) + "\n")
    assert main(["plot", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"{path}:2: not JSON" in err and "(line skipped)" in err
    assert f"{path}:4: no integer \"step\"" in err
    assert_png(run / "plots" / "loss.png")


@pytest.mark.parametrize(("setup", "message"), [
    ("no-dir", "no such folder"),
    ("no-file", "no metrics.jsonl there"),
    ("empty", "no metrics to plot (empty)"),
    ("all-malformed", "no metrics to plot (all 2 line(s) malformed)"),
    ("unknown-keys", "none of the plotted metrics is there (it has: episodes, zeta)"),
])
def test_errors_exit_2_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str,
                                            message: str) -> None:
    run = tmp_path / "run"
    if setup != "no-dir":
        run.mkdir()
    if setup == "empty":
        (run / "metrics.jsonl").write_text("\n")
    elif setup == "all-malformed":
        (run / "metrics.jsonl").write_text("oops\n[]\n")
    elif setup == "unknown-keys":
        (run / "metrics.jsonl").write_text('{"step": 1, "episodes": 3, "zeta": 1.0, "note": "x"}\n')
    assert main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.startswith("swectl: config error: ") == (setup in ("no-dir", "no-file")), err
    assert not list(run.glob("plots/*.png")) if run.exists() else True
