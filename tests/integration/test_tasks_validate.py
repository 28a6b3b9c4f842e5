"""`swectl tasks validate` on bundled tasks made wrong on purpose: each task gets the verdict its defect calls
for, the gradings are real (fresh Podman sandboxes), and a rerun with the same --out grades nothing again."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import msgspec
import pytest

from swectl.cli.main import main
from swectl.images.project import BUNDLED_TASKS
from swectl.remote.nodes.podman import local_podman_env
from swectl.tasks.sources import load_tasks

pytestmark = [pytest.mark.integration]


def podman(*args: str, input: bytes | None = None) -> None:
    subprocess.run(["podman", *args], input=input, capture_output=True, env=local_podman_env(), timeout=300,
                   check=True)


def test_validate_classifies_broken_tasks_and_resumes(tmp_path: Path) -> None:
    good, bad_patch, no_bug, drift = load_tasks(BUNDLED_TASKS, strict=True).tasks[:4]
    missing = "tests/test_swectl_missing.py::test_not_there"
    rows = [
        good.row(),
        {**bad_patch.row(), "patch": "diff --git a/nowhere.py b/nowhere.py\n--- a/nowhere.py\n+++ b/nowhere.py\n"
                                       "@@ -1 +1 @@\n-nothing here\n+still nothing\n"},
        # the listed FAIL_TO_PASS test passes without the fix: the tests do not see the bug
        {**no_bug.row(), "FAIL_TO_PASS": [no_bug.PASS_TO_PASS[0]], "PASS_TO_PASS": []},
        # a test the environment does not have fails in every gold run
        {**drift.row(), "FAIL_TO_PASS": [*drift.FAIL_TO_PASS, missing]},
    ]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    rc = main(["tasks", "validate", "--tasks", str(tasks), "--runs", "2", "--out", str(out)])
    assert rc == 1  # not every task validated
    report = json.loads((out / "validation.json").read_text())
    verdicts = {v["instance_id"]: v for v in report["instances"]}
    assert verdicts[good.instance_id]["valid"] is True
    assert verdicts[good.instance_id]["gold"] == ["resolved", "resolved"]
    assert verdicts[good.instance_id]["empty"] == "unresolved"
    assert verdicts[bad_patch.instance_id]["reason"] == "gold_patch_failed"
    assert verdicts[no_bug.instance_id]["reason"] == "empty_resolves"
    assert verdicts[drift.instance_id]["reason"] == "env_drift"
    assert verdicts[drift.instance_id]["tests"] == [missing]
    assert report["validated"] == 1
    assert report["reasons"] == {"empty_resolves": 1, "env_drift": 1, "gold_patch_failed": 1}
    assert (out / "validated.txt").read_text() == f"{good.instance_id}\n"
    assert report["overall"]["built_frac"] == 1.0
    assert report["overall"]["empty_resolved_frac"] == 0.25
    lines = (out / "grades.jsonl").read_bytes().splitlines()
    assert len(lines) == 4 * 3  # two gold runs and one empty per task

    # the same --out again: every grading is on record, none runs again, the verdicts are the same
    rc = main(["tasks", "validate", "--tasks", str(tasks), "--runs", "2", "--out", str(out)])
    assert rc == 1
    assert (out / "grades.jsonl").read_bytes().splitlines() == lines
    again = json.loads((out / "validation.json").read_text())
    assert [(v["instance_id"], v["reason"]) for v in again["instances"]] == \
        [(v["instance_id"], v["reason"]) for v in report["instances"]]
    assert msgspec.json.decode(lines[0])["result"]["instance_id"] in verdicts


def test_validate_grades_again_on_a_rebuilt_image(tmp_path: Path) -> None:
    task = load_tasks(BUNDLED_TASKS, strict=True).tasks[0]
    name = f"localhost/swectl-test-validate-{os.getpid()}:latest"
    podman("tag", task.image, name)
    try:
        (tmp_path / "map.json").write_text(json.dumps({task.instance_id: name}))
        args = ["tasks", "validate", "--tasks", str(BUNDLED_TASKS), "--instances", task.instance_id, "--runs", "1",
                "--image-map", str(tmp_path / "map.json"), "--out", str(tmp_path / "out")]
        assert main(args) == 0
        assert main(args) == 0
        grades = tmp_path / "out" / "grades.jsonl"
        assert len(grades.read_bytes().splitlines()) == 2  # the second run graded nothing
        # the same name, another image: the earlier gradings no longer count
        podman("build", "-t", name, "-", input=f"FROM {task.image}\nLABEL swectl.test=rebuilt\n".encode())
        assert main(args) == 0
        records = [msgspec.json.decode(line) for line in grades.read_bytes().splitlines()]
        assert len(records) == 4
        assert records[0]["image_id"] != records[2]["image_id"]
    finally:
        podman("rmi", "-f", name)
