"""The Metrics actor on real files: metrics.jsonl lines, TensorBoard scalars read back with tensorboard's own
EventAccumulator, resume truncation (JSONL and TensorBoard), non-finite values; StepProgress's text."""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from swectl.actors.metrics import METRICS_FILE, TENSORBOARD_DIR, Metrics, StepProgress, read_metrics
from swectl.schema import MetricsStatistics


def lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run / TENSORBOARD_DIR))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_log_writes_a_flushed_json_line_per_call_and_tensorboard_scalars(tmp_path: Path) -> None:
    with Metrics(tmp_path) as metrics:
        assert metrics.statistics() == MetricsStatistics(steps_logged=0, last_step=None)
        metrics.log(1, {"reward_mean": 0.25, "loss": 0.5, "episodes": 8, "eval/resolve_rate": 0.125})
        # visible before close: flushed as logged
        assert [r["step"] for r in lines(tmp_path)] == [1]
        metrics.log(2, {"reward_mean": 0.75, "loss": 0.25, "episodes": np.int64(8), "lr": np.float32(0.5)})
        assert metrics.statistics() == MetricsStatistics(steps_logged=2, last_step=2)
    first, second = lines(tmp_path)
    assert list(first) == ["step", "time", "reward_mean", "loss", "episodes", "eval/resolve_rate"]
    assert first["episodes"] == 8 and isinstance(first["episodes"], int)
    assert second["lr"] == 0.5 and second["episodes"] == 8
    assert abs(first["time"] - time.time()) < 60
    tb = scalars(tmp_path)
    assert tb["reward_mean"] == [(1, 0.25), (2, 0.75)]
    assert tb["loss"] == [(1, 0.5), (2, 0.25)]
    assert tb["episodes"] == [(1, 8.0), (2, 8.0)]
    assert tb["eval/resolve_rate"] == [(1, 0.125)]
    assert tb["lr"] == [(2, 0.5)]


def test_non_finite_values_are_null_in_json_and_absent_from_tensorboard(tmp_path: Path) -> None:
    with Metrics(tmp_path) as metrics:
        metrics.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "kl_mean": -math.inf,
                        "entropy": np.float64("nan"), "lr": 1e-6, "note": "skipped", "none": None, "flag": True})
    (record,) = lines(tmp_path)
    assert record["loss"] is None and record["grad_norm"] is None and record["kl_mean"] is None
    assert record["entropy"] is None and record["none"] is None
    assert record["note"] == "skipped" and record["flag"] is True and record["lr"] == 1e-6
    text = (tmp_path / METRICS_FILE).read_text()
    assert "NaN" not in text and "Infinity" not in text
    tb = scalars(tmp_path)
    assert set(tb) == {"lr", "flag"}
    assert tb["flag"] == [(1, 1.0)]


def test_reserved_names_are_refused(tmp_path: Path) -> None:
    with Metrics(tmp_path) as metrics, pytest.raises(ValueError, match="reserved"):
        metrics.log(1, {"step": 3})


def test_resume_drops_later_steps_atomically_and_tensorboard_purges_them(tmp_path: Path) -> None:
    with Metrics(tmp_path) as metrics:
        for step in (0, 1, 2, 3):
            metrics.log(step, {"loss": float(step)})
        metrics.log(3, {"eval/resolve_rate": 0.5})
    # killed after logging steps 3 (never checkpointed); the checkpoint is step 2
    with Metrics(tmp_path, resume_step=2) as metrics:
        assert [r["step"] for r in lines(tmp_path)] == [0, 1, 2]
        assert metrics.statistics() == MetricsStatistics(steps_logged=3, last_step=2)
        metrics.log(3, {"loss": 30.0})
    assert [(r["step"], r.get("loss")) for r in lines(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed into place
    tb = scalars(tmp_path)
    assert tb["loss"] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]  # step 3 once, the new value
    assert tb.get("eval/resolve_rate", []) == []


def test_resume_without_later_steps_leaves_the_file_alone(tmp_path: Path) -> None:
    with Metrics(tmp_path) as metrics:
        metrics.log(1, {"loss": 1.0})
    before = (tmp_path / METRICS_FILE).stat().st_ino
    with Metrics(tmp_path, resume_step=1) as metrics:
        assert metrics.statistics().last_step == 1
    assert (tmp_path / METRICS_FILE).stat().st_ino == before  # not rewritten


def test_resume_drops_a_line_cut_short_and_malformed_ones(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    with Metrics(tmp_path, resume_step=5) as metrics:
        metrics.log(3, {"loss": 3.0})
    assert [r["step"] for r in lines(tmp_path)] == [1, 2, 3]


def test_appending_after_a_line_cut_short_starts_a_new_line(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    with Metrics(tmp_path) as metrics:
        metrics.log(3, {"loss": 3.0})
    records, problems = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 3]
    assert len(problems) == 1 and problems[0].startswith(f"{tmp_path / METRICS_FILE}:2: not JSON")


def test_read_metrics_names_each_malformed_line(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1}\n\n[1, 2]\n{"loss": 1}\n{"step": "3"}\n{"step": true}\n{oops\n{"step": 7}\n')
    records, problems = read_metrics(path)
    assert [r["step"] for r in records] == [1, 7]
    assert [p.split(":")[1] for p in problems] == ["3", "4", "5", "6", "7"]
    assert "a JSON list, not an object" in problems[0]


def test_leaving_its_block_closes_tensorboard_and_the_jsonl_goes_on(tmp_path: Path) -> None:
    with Metrics(tmp_path) as metrics:
        metrics.log(1, {"loss": 1.0})
    assert metrics._writer is None
    metrics.log(2, {"loss": 2.0})  # after close: the JSONL still gets it
    assert [r["step"] for r in lines(tmp_path)] == [1, 2]
    assert scalars(tmp_path)["loss"] == [(1, 1.0)]


# ---------------------------------------------------------------- StepProgress


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_prints_a_line_per_step_when_not_a_tty() -> None:
    out, clock = io.StringIO(), Clock()
    progress = StepProgress(50, 5, stream=out, clock=clock)
    clock.now += 144  # two steps of this run in 144 s: 72 s a step, 43 to go
    progress.update(7, {"reward_mean": 0.42, "resolve_rate": 0.375, "loss": 0.0123, "train_tokens_per_s": 1234.0,
                        "weight_version": 7.0})
    progress.update(8, {"loss": float("nan"), "skipped": 1.0, "weight_version": 7.0})
    clock.now += 3600 * 3
    progress.update(50, {"tokens_per_s": 2.5e6, "train_tokens_per_s": 10.0})
    progress.close()
    assert out.getvalue().splitlines() == [
        "step 7/50  reward 0.42  resolved 38%  loss 0.0123  1.2k tok/s  v7  ETA 52m",
        "step 8/50  loss nan  v7  skipped  ETA 34m",
        "step 50/50  2.5M tok/s  took 3h02m",
    ]
    assert "\r" not in out.getvalue()


def test_progress_rewrites_one_line_on_a_tty() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    progress = StepProgress(3, 0, stream=out)
    progress.update(1, {"loss": 1.0})
    progress.update(2, {"loss": 0.5})
    assert out.getvalue().count("\r\033[K") == 2 and "\n" not in out.getvalue()
    progress.close()
    progress.close()
    assert out.getvalue().endswith("step 2/3  loss 0.5  ETA 0s\n") and out.getvalue().count("\n") == 1


def test_progress_first_step_has_no_eta_without_a_finished_step() -> None:
    out = io.StringIO()
    StepProgress(10, 4, stream=out).update(4, {})
    assert out.getvalue() == "step 4/10\n"
