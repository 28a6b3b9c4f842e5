"""`swectl eval` in validation mode on the whole bundled set, on both sandbox backends (every gold patch
resolves, no empty patch does), and on a SWE-bench predictions file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swectl.cli.main import main
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.sources import load_tasks

pytestmark = [pytest.mark.integration]


def report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_bundled_set_is_big_enough_and_diverse() -> None:
    tasks = load_tasks(BUNDLED_TASKS, strict=True).tasks
    assert len(tasks) >= 30
    assert len({t.repo for t in tasks}) >= 3
    for t in tasks:
        assert t.source == "swectl-synth"
        assert t.setup_patch
        assert t.patch
        assert t.FAIL_TO_PASS
        assert not set(t.FAIL_TO_PASS) & set(t.PASS_TO_PASS)
        assert t.patch not in t.problem_statement


@pytest.mark.parametrize("backend", ["podman", "namespace"])
@pytest.mark.parametrize("mode", ["gold", "empty"])
def test_validation_on_bundled_set(
    mode: str, backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["eval", f"--{mode}", "--concurrency", "4", "--set", f'sandbox.backend="{backend}"',
               "--out", str(tmp_path)])  # fmt: skip
    r = report(tmp_path)
    assert rc == 0, capsys.readouterr().out[-3000:]
    assert r["total"] == len(load_tasks(BUNDLED_TASKS).tasks)
    assert r["errors"] == 0
    assert r["resolve_rate"] == (1.0 if mode == "gold" else 0.0)
    assert f"{mode}: " in capsys.readouterr().out


def test_predictions_file(tmp_path: Path) -> None:
    tasks = load_tasks(BUNDLED_TASKS, strict=True).tasks[:4]
    preds = [
        {"instance_id": tasks[0].instance_id, "model_name_or_path": "m", "model_patch": tasks[0].patch},
        {"instance_id": tasks[1].instance_id, "model_name_or_path": "m", "model_patch": ""},
        {"instance_id": tasks[2].instance_id, "model_name_or_path": "m", "model_patch": "not a patch\n"},
    ]
    path = tmp_path / "preds.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in preds))
    ids = [t.instance_id for t in tasks]
    rc = main(["eval", "--predictions", str(path), "--instances", *ids, "--out", str(tmp_path / "out")])
    r = report(tmp_path / "out")
    assert rc == 0
    assert r["total"] == 3  # the task without a prediction is not graded
    assert r["mode"] == "predictions" and r["model"] == "m" and r["infra_errors"] == 0
    assert r["resolved_ids"] == [tasks[0].instance_id]
    assert r["unresolved_ids"] == [tasks[1].instance_id]
    assert r["error_ids"] == [tasks[2].instance_id]
    assert r["error_reasons"] == {"patch_apply_failed": 1}


def test_bad_predictions_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "preds.json"
    path.write_text('[{"model_patch": "x"}]')
    assert main(["eval", "--predictions", str(path), "--out", str(tmp_path / "o")]) == 2
    assert "instance_id" in capsys.readouterr().err


def test_predictions_for_unknown_instances_are_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Predictions partly for another task set: the unknown ids are named, the header counts what is graded."""
    task = load_tasks(BUNDLED_TASKS, strict=True).tasks[0]
    path = tmp_path / "preds.jsonl"
    rows = [{"instance_id": task.instance_id, "model_patch": task.patch},
            {"instance_id": "django__django-11099", "model_patch": ""}]
    path.write_text("".join(json.dumps(p) + "\n" for p in rows))
    assert main(["eval", "--predictions", str(path), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "1 of 2 predictions are for instances not in the task set" in err and "django__django-11099" in err
    assert "grading 1 tasks (predictions)" in err
    assert report(tmp_path / "out")["resolved_ids"] == [task.instance_id]
