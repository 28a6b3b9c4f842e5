"""The task factory on a real project in real sandboxes: kept mutants break 1..N tests and nothing else,
statements never quote the changed code, and the same seed gives the same tasks."""

from __future__ import annotations

import uuid

import anyio
import pytest

from swectl.actors.env_pool import running_pool
from swectl.config import load_config
from swectl.images.project import build_project_image, load_projects
from swectl.synth.factory import SynthConfig, synth_project
from swectl.tasks.record import Task

pytestmark = [pytest.mark.integration]


def synth(seed: int) -> list[Task]:
    projects = load_projects()
    project = projects.get("inflection")
    built = build_project_image(project, projects.runner, say=lambda _m: None)
    cfg = SynthConfig(seed=seed, max_tasks=2, max_candidates=16, concurrency=2)

    async def main() -> list[Task]:
        async with running_pool(load_config(None, ["env_pool.warm=0"]), "s" + uuid.uuid4().hex[:12]) as pool:
            tasks, stats = await synth_project(pool, project, built, cfg, say=lambda _m: None)
            assert stats.candidates >= stats.kept
            return tasks

    return anyio.run(main)


def test_synth_is_deterministic_and_valid() -> None:
    first = synth(seed=7)
    assert first, "no mutant of inflection kept"
    assert [t.row() for t in synth(seed=7)] == [t.row() for t in first]
    for t in first:
        assert 1 <= len(t.FAIL_TO_PASS) <= 30
        assert t.PASS_TO_PASS
        assert t.setup_patch.startswith("diff --git")
        assert t.patch.startswith("diff --git")
        assert any(f2p in t.problem_statement for f2p in t.FAIL_TO_PASS)
        added = [ln[1:].strip() for ln in t.setup_patch.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
        assert added
        assert all(a not in t.problem_statement for a in added)


CALC = '''\
def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value


def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def is_even(n):
    return n % 2 == 0
'''

TEST_CALC = '''\
import pytest
from calc import clamp, is_even, mean


@pytest.mark.parametrize("v,expected", [(-5, 0), (5, 5), (50, 10), (0, 0), (10, 10)])
def test_clamp(v, expected):
    assert clamp(v, 0, 10) == expected


def test_mean():
    assert mean([1, 2, 3, 6]) == 3


def test_mean_single():
    assert mean([4]) == 4


@pytest.mark.parametrize("n", [0, 2, 4])
def test_even(n):
    assert is_even(n)


@pytest.mark.parametrize("n", [1, 3])
def test_odd(n):
    assert not is_even(n)
'''


def test_synth_from_a_git_checkout(tmp_path) -> None:
    import subprocess

    from swectl.actors.grader import Grader, GraderConfig
    from swectl.images.project import Project
    from swectl.remote.nodes.podman import run_local_podman

    repo = tmp_path / "calc"
    repo.mkdir()
    (repo / "calc.py").write_text(CALC)
    (repo / "test_calc.py").write_text(TEST_CALC)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "calc"], check=True)
    project = Project(name="calc-" + uuid.uuid4().hex[:6], version="0.1", git=str(repo), tests=["test_calc.py"],
                      sources=["calc.py"])
    built = build_project_image(project, load_projects().runner, say=lambda _m: None)
    try:
        cfg = SynthConfig(seed=1, max_tasks=3, max_candidates=20)

        async def main() -> list[str]:
            async with running_pool(load_config(None, ["env_pool.warm=0"]), "s" + uuid.uuid4().hex[:12]) as pool:
                tasks, _ = await synth_project(pool, project, built, cfg, say=lambda _m: None)
                assert tasks, "no mutant of calc kept"
                async with anyio.create_task_group() as tg:
                    grader = Grader(GraderConfig(), pool)
                    statuses = [(await grader.grade(t, t.patch)).status for t in tasks] + [
                        (await grader.grade(t, "")).status for t in tasks]
                    tg.cancel_scope.cancel()
                return statuses

        statuses = anyio.run(main)
        half = len(statuses) // 2
        assert statuses[:half] == ["resolved"] * half
        assert statuses[half:] == ["unresolved"] * half
    finally:
        run_local_podman("rmi", "-f", built.image, check=False)
