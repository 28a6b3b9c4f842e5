"""Harbor task folders as swectl tasks (swectl/tasks/harbor.py, swectl/images/harbor.py, the Grader's Harbor path):
the bundled terminal tasks build offline, their solve.sh makes a gold patch that scores 1 and the empty patch scores 0,
and nothing an agent can plant scores: a reward file or a test script in the work folder, the same written outside it
in the agent's own sandbox (the grader sees only the diff), a path out of the work folder, pytest configuration, git
metadata. The same tasks run through `swectl eval --gold` / `--empty` and an agent episode of the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import anyio
import pytest

from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig, GradeResult
from swectl.config import load_config
from swectl.images.harbor import prepare_harbor_tasks
from swectl.tasks.record import TESTBED, Task
from swectl.tasks.sources import load_tasks
from swectl.testing.harbor import BUNDLED_HARBOR

pytestmark = [pytest.mark.integration]



@pytest.fixture(scope="module")
def harbor_tasks() -> dict[str, Task]:
    loaded = load_tasks(BUNDLED_HARBOR, strict=True)
    tasks, problems = prepare_harbor_tasks(loaded.tasks)
    assert not problems, problems
    return {t.instance_id: t for t in tasks}


def _new_file(path: str, text: str) -> str:
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n{body}")


PLANT_REWARD = "#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"


def attacks() -> dict[str, str]:
    return {
        "reward_in_workdir": _new_file("logs/verifier/reward.txt", "1"),
        "test_script_in_workdir": _new_file("tests/test.sh", PLANT_REWARD),
        "path_out_of_workdir": _new_file("../logs/verifier/reward.txt", "1"),
        "root_conftest": _new_file("conftest.py", "def pytest_runtest_makereport(item, call):\n    pass"),
        "pytest_ini": _new_file("pytest.ini", "[pytest]\naddopts = -p hack"),
        "gitattributes_filter": _new_file(".gitattributes", "* filter=hack"),
        "shadow_pytest": _new_file("pytest.py", "import sys\nsys.exit(0)"),
        "sitecustomize": _new_file("sitecustomize.py", "import os\nos.environ['X'] = '1'"),
    }


async def grade_all(pairs: dict[str, tuple[Task, str]]) -> dict[str, GradeResult]:
    config = load_config(None, ["env_pool.warm=0"])
    results: dict[str, GradeResult] = {}
    async with running_pool(config, "hb" + uuid.uuid4().hex[:10]) as pool:
        grader = Grader(GraderConfig(concurrency=4), pool)

        async def one(name: str, task: Task, patch: str) -> None:
            results[name] = await grader.grade(task, patch, label=name)

        async with anyio.create_task_group() as tg:
            for name, (task, patch) in pairs.items():
                tg.start_soon(one, name, task, patch)
    return results


async def planted_in_the_agents_sandbox(task: Task) -> str:
    """An agent that writes a reward file and a test script where the verifier reads them, in its own sandbox
    (outside the work folder), and the answer's reward file inside it: what the grader gets is the diff."""
    config = load_config(None, ["env_pool.warm=0"])
    async with running_pool(config, "hb" + uuid.uuid4().hex[:10]) as pool, pool.lease(task.image) as lease:
        script = ("mkdir -p /logs/verifier /tests && echo 1 > /logs/verifier/reward.txt && "
                  f"printf '%s' {json.dumps(PLANT_REWARD)} > /tests/test.sh && echo 1 > {TESTBED}/reward.txt")
        r = await lease.exec(script, 60, cwd=TESTBED)
        assert r.exit_code == 0, r.output
        return (await lease.diff(TESTBED)).decode()


@pytest.mark.anyio
async def test_harbor_tasks_gold_scores_and_nothing_planted_does(harbor_tasks: dict[str, Task]) -> None:
    target = harbor_tasks["log-error-counts"]
    planted = await planted_in_the_agents_sandbox(target)
    assert "reward.txt" in planted and "/logs" not in planted  # only the work folder's file came along
    pairs = {f"gold:{n}": (t, t.patch) for n, t in harbor_tasks.items()}
    pairs |= {f"empty:{n}": (t, "") for n, t in harbor_tasks.items()}
    pairs |= {name: (target, patch) for name, patch in attacks().items()}
    pairs["planted_in_sandbox"] = (target, planted)
    results = await grade_all(pairs)
    table = "\n".join(f"{n:<24} {r.status:<10} {r.reason:<16} {r.reward} {(r.detail or '')[:90]}"
                      for n, r in results.items())
    for name in harbor_tasks:
        assert results[f"gold:{name}"].status == "resolved" and results[f"gold:{name}"].reward == 1.0, table
        assert results[f"empty:{name}"].status == "unresolved" and results[f"empty:{name}"].reward == 0.0, table
    for name in ("reward_in_workdir", "test_script_in_workdir", "planted_in_sandbox"):
        assert results[name].status == "unresolved" and results[name].reward == 0.0, table  # the verifier ran
    assert results["path_out_of_workdir"].status == "error", table
    assert results["path_out_of_workdir"].reason == "patch_apply_failed", table
    for name in ("root_conftest", "pytest_ini", "gitattributes_filter", "shadow_pytest", "sitecustomize"):
        assert results[name].status == "tampered", table
    assert not any(r.infra for r in results.values()), table


def test_swectl_eval_runs_harbor_tasks_gold_empty_and_an_agent(harbor_tasks: dict[str, Task],
                                                               model: Path, tmp_path: Path) -> None:
    swectl = [sys.executable, "-m", "swectl.cli.main"]
    for mode in ("--gold", "--empty"):
        out = tmp_path / mode.strip("-")
        run = subprocess.run([*swectl, "eval", mode, "--tasks", str(BUNDLED_HARBOR), "--out", str(out)],
                             capture_output=True, text=True, timeout=600, check=False)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        report = json.loads((out / "report.json").read_text())
        assert report["resolved"] == (3 if mode == "--gold" else 0) and report["errors"] == 0, report
    out = tmp_path / "agent"
    run = subprocess.run([*swectl, "eval", "--model", str(model), "--tasks", str(BUNDLED_HARBOR), "--instances",
                          "log-error-counts", "--step-limit", "2", "--max-tokens", "24", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode in (0, 1), run.stdout[-2000:] + run.stderr[-2000:]
    row = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert row["grade"]["reward"] is not None and not row["grade"]["infra"], row  # graded by the task's verifier
    prompt = json.loads((out / "log-error-counts__0" / "traj.json").read_text())["episode"]["trajectory"]
    assert "errors.json" in prompt["messages"][1]["content"]  # the task's instruction.md reached the agent


def test_swectl_up_trains_on_harbor_tasks(harbor_tasks: dict[str, Task], model: Path, tmp_path: Path) -> None:
    """A GRPO step of `swectl up` whose task set is the Harbor folder: its episodes graded by the tasks' verifiers."""
    sets = {"out_dir": repr(str(tmp_path)), "run_id": "'harbor-up'", "train.model": repr(str(model)),
            "train.data.tasks": repr(str(BUNDLED_HARBOR)), "train.data.test_fraction": 0.34,
            "train.sampling.tasks_per_step": 2, "train.sampling.n_samples": 2,
            "train.sampling.dynamic_sampling": "false", "rollout.step_limit": 1, "rollout.max_tokens": 16,
            "env_pool.warm": 0}
    argv = [sys.executable, "-m", "swectl.cli.main", "up", "--recipe", "train", "--steps", "1"]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    step = json.loads((tmp_path / "harbor-up" / "steps.jsonl").read_text().splitlines()[0])
    assert set(step["tasks"]) <= set(harbor_tasks) and len(step["rewards"]) == 2, step
    metas = sorted((tmp_path / "harbor-up" / "episodes" / "step_000001").glob("*__*/meta.json"))
    assert len(metas) == 4
    for meta in metas:
        grade = json.loads(meta.read_text())["grade"]
        assert grade["reward"] is not None and not grade["infra"], grade  # the task's own verifier ran


@pytest.mark.anyio
async def test_a_harbor_tasks_cpus_and_memory_bound_its_sandboxes(harbor_tasks: dict[str, Task]) -> None:
    """``[environment] cpus`` and ``memory_mb`` reach the sandbox's cgroup (here 0.5 CPU and 512 MiB, against the
    [sandbox] section's 1 CPU and 2 GiB for a task that sets none)."""
    import re

    import msgspec

    from swectl.tasks.harbor import sandbox_limits

    task = harbor_tasks["csv-region-totals"]
    extra = {**task.extra, "harbor": {**task.extra["harbor"], "cpus": 0.5, "memory_mb": 512}}
    limited = msgspec.structs.replace(task, extra=extra)
    config = load_config(None, ["env_pool.warm=0"])
    seen = []
    async with running_pool(config, "hb" + uuid.uuid4().hex[:10]) as pool:
        for t in (limited, msgspec.structs.replace(task, source="swectl-synth")):
            async with pool.lease(t.image, **sandbox_limits(t)) as lease:
                groups = (await lease.exec("cat /proc/self/cgroup", 30)).output
                memory = re.search(r":memory:(\S+)", groups).group(1)
                cpu = re.search(r":cpu:(\S+)", groups).group(1)
                limit = await anyio.Path(f"/sys/fs/cgroup/memory{memory}/memory.limit_in_bytes").read_text()
                quota = await anyio.Path(f"/sys/fs/cgroup/cpu{cpu}/cpu.cfs_quota_us").read_text()
                seen.append((int(limit), int(quota)))
    assert seen == [(512 << 20, 50_000), (2 << 30, 100_000)], seen


def test_tasks_validate_and_an_environment_this_machine_cannot_build(harbor_tasks: dict[str, Task],
                                                                     tmp_path: Path) -> None:
    """`swectl tasks validate` on the Harbor folder: gold (solve.sh) scores 1 in every run, doing nothing does not.
    A task FROM an image this machine cannot pull is one problem naming the image, the others still prepared."""
    import shutil

    out = tmp_path / "validate"
    run = subprocess.run([sys.executable, "-m", "swectl.cli.main", "tasks", "validate", "--tasks", str(BUNDLED_HARBOR),
                          "--runs", "2", "--out", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert sorted((out / "validated.txt").read_text().split()) == sorted(harbor_tasks)
    folder = tmp_path / "tasks"
    shutil.copytree(BUNDLED_HARBOR / "log-error-counts", folder / "log-error-counts")
    shutil.copytree(BUNDLED_HARBOR / "log-error-counts", folder / "on-ubuntu")
    dockerfile = folder / "on-ubuntu" / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace("debian:bookworm-slim", "ubuntu:24.04"))
    tasks, problems = prepare_harbor_tasks(load_tasks(folder, strict=True).tasks)
    assert [t.instance_id for t in tasks] == ["log-error-counts"] and tasks[0].patch
    assert len(problems) == 1 and problems[0].location.endswith("on-ubuntu"), problems
    assert "FROM ubuntu:24.04: not on this machine" in problems[0].message, problems
