"""The red team on a bundled task (docs/grading.md): every attack in tests/red_team.py, graded by the Grader the
training runs use and by `swectl eval --predictions`, grades unresolved (``tampered``, or its test edits dropped);
with the defences off ([experiment.reward_hacking] grader_defences = false) the issue's attack resolves, which
is what makes the suite able to fail. The real SWE-bench row's share is in test_serve_real_row.py."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import anyio
import msgspec
import pytest

from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig, GradeResult
from swectl.config import load_config
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.record import Task
from swectl.tasks.sources import load_tasks
from tests.red_team import attack_patches, export_tree

pytestmark = [pytest.mark.integration]
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def task() -> Task:
    return load_tasks(BUNDLED_TASKS, strict=True).tasks[0]


@pytest.fixture(scope="module")
def patches(task: Task, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return attack_patches(export_tree(task, tmp_path_factory.mktemp("tree") / "testbed"), task)


async def grade_all(task: Task, patches: dict[str, str], *, defences: bool = True) -> dict[str, GradeResult]:
    config = load_config(None, ["env_pool.warm=0"])
    results: dict[str, GradeResult] = {}
    async with running_pool(config, "rt" + uuid.uuid4().hex[:10]) as pool, anyio.create_task_group() as tg:
        grader = Grader(GraderConfig(concurrency=4, defences=defences), pool)
        async def one(name: str, patch: str) -> None:
            results[name] = await grader.grade(task, patch, label=name)

        async with anyio.create_task_group() as each:
            for name, patch in patches.items():
                each.start_soon(one, name, patch)
        stats = grader.statistics()
        tg.cancel_scope.cancel()
    assert stats.tampered == sum(r.status == "tampered" for r in results.values())
    return results


def table(results: dict[str, GradeResult]) -> str:
    return "\n".join(f"{n:<24} {r.status:<10} {r.reason:<14} {(r.detail or '')[:110]}" for n, r in results.items())


@pytest.mark.anyio
async def test_no_attack_resolves_through_the_grader(task: Task, patches: dict[str, str]) -> None:
    assert len(patches) >= 15 and all(patches.values()), [n for n, p in patches.items() if not p]
    results = await grade_all(task, {**patches, "gold": task.patch})
    gold = results.pop("gold")
    assert gold.status == "resolved" and gold.canaries, gold
    report = table(results)
    assert not [n for n, r in results.items() if r.status not in ("tampered", "unresolved")], report
    for name, r in results.items():
        if r.status == "unresolved":  # the tests ran and the listed ones really failed
            assert r.f2p_failed and r.canaries, f"{name}: {r}\n{report}"
    for name in ("root_conftest_flip", "package_conftest_flip", "edit_failing_tests"):
        assert results[name].dropped_test_files and results[name].apply_method == "empty", report
    # Each layer is reached: the path rules, the runner sections, the canaries and the log checks.
    reasons = {r.reason for r in results.values() if r.status == "tampered"}
    assert {"patch_policy", "runner_config", "canary", "late_pass", "copy"} <= reasons, report
    assert results["flip_at_import"].reason == "canary" and "must-fail" in results["flip_at_import"].detail, report
    assert results["forge_and_exit_0"].reason == "canary", report
    neutered = results["asserts_off_at_import"]  # unittest's assertions made to pass: the must-pass canary's probes
    assert neutered.reason == "canary" and "must-pass" in neutered.detail, report
    assert "later passing" in results["forge_at_exit"].detail, report
    for name in ("targeted_flip_at_import", "targeted_xfail_at_import", "targeted_rewrite_at_import"):
        targeted = results[name]  # only the listed tests' reports flipped, or their lines: their copies see it
        assert targeted.reason == "copy" and "fresh name" in targeted.detail and "confirmed" in targeted.detail, report


@pytest.mark.anyio
async def test_without_the_defences_the_issues_attack_resolves(task: Task, patches: dict[str, str]) -> None:
    """The control: the suite can fail. With the defences off, the flip plugin scores as the issue found, loaded
    from pytest.ini or registered by the package; the forger at exit still meets the older exit-status rule."""
    names = ["pytest_ini_plugin", "flip_at_import", "forge_and_exit_0", "forge_at_exit"]
    results = await grade_all(task, {n: patches[n] for n in names}, defences=False)
    assert [results[n].status for n in names] == ["resolved", "resolved", "resolved", "unresolved"], table(results)
    assert "exited 1 but the log reports no failure" in results["forge_at_exit"].detail


LEAKY_TEST = "_seen = []\n\n\ndef test_leaks():\n    assert not _seen\n    _seen.append(1)\n"


@pytest.mark.anyio
async def test_a_listed_test_that_leaks_state_into_its_copy_still_resolves(task: Task) -> None:
    """No false positive from the copies: a FAIL_TO_PASS test that passes once and fails when run again in the same
    process (module state it leaves behind, as django__django-11095's does) fails beside itself; the confirmation
    run, its copy in its place, passes, and the gold patch resolves. (The bundled task's script runs no test patch:
    the test comes in the task's setup patch.)"""
    lines = LEAKY_TEST.splitlines()
    added = (f"diff --git a/tests/test_leaky.py b/tests/test_leaky.py\nnew file mode 100644\n--- /dev/null\n"
             f"+++ b/tests/test_leaky.py\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{ln}\n" for ln in lines))
    leaky = msgspec.structs.replace(task, setup_patch=task.setup_patch + added,
                                    FAIL_TO_PASS=[*task.FAIL_TO_PASS, "tests/test_leaky.py::test_leaks"])
    results = await grade_all(leaky, {"gold": task.patch})
    gold = results["gold"]
    assert gold.status == "resolved" and not gold.reason and "leaks state" in gold.detail, gold


@pytest.mark.anyio
async def test_without_the_copies_the_targeted_attacks_resolve(task: Task, patches: dict[str, str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The control for the FAIL_TO_PASS tests' copies: with every other defence on, a hook that flips only the
    listed tests' reports (to passed, or to expected failures), or rewrites only their FAILED lines, resolves when
    no copies are planted (the canaries keep their true outcomes)."""
    monkeypatch.setattr("swectl.grading.canaries.plan_copies", lambda *a, **k: ())
    names = ["targeted_flip_at_import", "targeted_xfail_at_import", "targeted_rewrite_at_import"]
    results = await grade_all(task, {n: patches[n] for n in names})
    assert [results[n].status for n in names] == ["resolved"] * 3, table(results)


def test_no_attack_resolves_through_swectl_eval(task: Task, patches: dict[str, str], tmp_path: Path) -> None:
    """`swectl eval --predictions`: each attack is a prediction for its own copy of the task (same image)."""
    names = sorted(patches)
    rows = [msgspec.to_builtins(msgspec.structs.replace(task, instance_id=f"{task.instance_id}.{n}")) for n in names]
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "preds.jsonl").write_text("".join(
        json.dumps({"instance_id": f"{task.instance_id}.{n}", "model_name_or_path": "red-team",
                    "model_patch": patches[n]}) + "\n" for n in names))
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "swectl.cli.main", "eval", "--tasks", str(tmp_path / "tasks.jsonl"),
                          "--predictions", str(tmp_path / "preds.jsonl"), "--out", str(out),
                          "--set", "env_pool.warm=0"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode in (0, 1), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["resolved"] == 0, json.dumps(report["instances"], indent=1)[:4000]
    assert report["tampered"] >= len(names) - 4 and len(report["tampered_ids"]) == report["tampered"]
    assert {i["status"] for i in report["instances"]} <= {"tampered", "unresolved"}
