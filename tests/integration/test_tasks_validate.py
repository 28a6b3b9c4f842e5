"""`swectl tasks validate` on bundled tasks made wrong on purpose: each task gets the verdict its defect calls
for, the gradings are real (fresh Podman sandboxes), and a rerun with the same --out grades nothing again; with
--prune each built image is removed once judged and a rerun keeps the verdicts."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import anyio
import msgspec
import pytest

from swectl.cli.main import main
from swectl.config import load_config
from swectl.eval.validate import environment_key, validate_tasks
from swectl.images.instance import InstanceOutcome, remove_instance_image
from swectl.images.project import BUNDLED_TASKS, image_id
from swectl.remote.nodes.podman import local_podman_env
from swectl.tasks.record import Task
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


def test_prune_removes_each_built_image_after_its_verdict_and_a_rerun_keeps_the_verdicts(tmp_path: Path) -> None:
    """--prune's contract, on images made here for the test: each image a build made is removed once its task is
    judged, never more than jobs + 1 built images wait, and the same --out again builds and grades nothing."""
    tasks = load_tasks(BUNDLED_TASKS, strict=True).tasks[:3]
    names = {t.instance_id: f"localhost/swectl-test-prune-{os.getpid()}-{i}:latest" for i, t in enumerate(tasks)}
    built: list[str] = []
    alive: set[str] = set()
    last: list[bool] = []
    most_alive = 0

    def build(task: Task) -> InstanceOutcome:
        nonlocal most_alive
        podman("tag", task.image, names[task.instance_id])
        built.append(task.instance_id)
        alive.add(task.instance_id)
        most_alive = max(most_alive, len(alive))
        return InstanceOutcome(instance_id=task.instance_id, status="built", image=names[task.instance_id])

    def prune(outcome: InstanceOutcome, environment_done: bool) -> None:
        assert remove_instance_image(outcome.image)
        alive.discard(outcome.instance_id)
        last.append(environment_done)

    config = load_config(None)
    out = tmp_path / "out"
    out.mkdir()
    try:
        report = anyio.run(lambda: validate_tasks(config, tasks, out, build=build, runs=1, jobs=1, prune=prune,
                                                  progress=False))
        assert report.validated == 3 and sorted(built) == sorted(names)
        assert not alive and most_alive <= 2  # jobs + 1
        # the three bundled tasks share one environment: it is done with the last one judged
        assert {environment_key(t) for t in tasks} == {environment_key(tasks[0])} and last == [False, False, True]
        assert sorted((out / "built.txt").read_text().split()) == sorted(names.values())
        assert all(image_id(name) is None for name in names.values())  # really gone from podman
        grades = (out / "grades.jsonl").read_bytes()
        built.clear()
        again = anyio.run(lambda: validate_tasks(config, tasks, out, build=build, runs=1, jobs=1, prune=prune,
                                                 progress=False))
        assert built == [] and (out / "grades.jsonl").read_bytes() == grades
        assert [v.instance_id for v in again.instances] == [v.instance_id for v in report.instances]
        assert again.versions == report.versions

        # a run cut off after a build, before its verdict: the rerun finds the image up to date ("cached") and,
        # as this --out built it (built.txt), prunes it; an image this --out did not build is never pruned
        cut = tmp_path / "cut"
        cut.mkdir()
        (cut / "built.txt").write_text(names[tasks[0].instance_id] + "\n")

        def cached(task: Task) -> InstanceOutcome:
            podman("tag", task.image, names[task.instance_id])
            return InstanceOutcome(instance_id=task.instance_id, status="cached", image=names[task.instance_id])

        alive.update(t.instance_id for t in tasks[:2])
        anyio.run(lambda: validate_tasks(config, tasks[:2], cut, build=cached, runs=1, prune=prune, progress=False))
        assert image_id(names[tasks[0].instance_id]) is None and image_id(names[tasks[1].instance_id])
    finally:
        for name in names.values():
            podman("rmi", "-f", name)
