"""swectl's grader agrees with the official SWE-bench harness (swebench 5.x ``run_instance``, run through
Podman's Docker-compatible API) on the same tasks and patches: gold, empty, a wrong fix, a patch that
breaks a passing test, and a patch that does not apply."""

from __future__ import annotations

import uuid

import anyio
import pytest

from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig
from swectl.config import load_config
from swectl.grading.official_harness import grade_official
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.record import Task
from swectl.tasks.sources import load_tasks

pytestmark = [pytest.mark.integration]


def cases() -> list[tuple[str, Task, str]]:
    tasks = load_tasks(BUNDLED_TASKS, strict=True).tasks
    by_repo: dict[str, list[Task]] = {}
    for t in tasks:
        by_repo.setdefault(t.repo, []).append(t)
    out = []
    for repo, ts in sorted(by_repo.items())[:2]:
        a, b = ts[0], ts[1]
        out += [
            ("gold", a, a.patch),
            ("empty", a, ""),
            # Another task's fix: its result is already in a's tree (its reverse applies), so both graders
            # take it as an applied no-op, and a stays broken.
            ("other-fix", a, b.patch),
            ("garbage", a, "--- a/nothing\n+++ b/nothing\n@@ -1 +1 @@\n-x\n+y\n"),
        ]
        if repo == sorted(by_repo)[0]:
            out.append(("gold+other-bug", a, a.patch + b.setup_patch))
    return out


def test_grader_agrees_with_official_harness() -> None:
    jobs = cases()
    official = grade_official([(t, p) for _, t, p in jobs], workers=4, timeout_s=600)

    async def ours() -> list[str]:
        config = load_config(None, ["env_pool.warm=0"])
        results: list[str] = [""] * len(jobs)
        async with running_pool(config, "o" + uuid.uuid4().hex[:12]) as pool:
            grader = Grader(GraderConfig(concurrency=4), pool)

            async def one(i: int, task: Task, patch: str) -> None:
                results[i] = (await grader.grade(task, patch)).status

            async with anyio.create_task_group() as tg:
                async with anyio.create_task_group() as jobs_tg:
                    for i, (_, t, p) in enumerate(jobs):
                        jobs_tg.start_soon(one, i, t, p)
                tg.cancel_scope.cancel()
        return results

    mine = anyio.run(ours)
    table = [(name, t.instance_id, m, o.resolved, o.error) for (name, t, _), m, o in zip(jobs, mine, official,
                                                                                         strict=True)]
    for name, iid, m, resolved, error in table:
        assert (m == "resolved") == resolved, f"{name} {iid}: swectl {m}, official resolved={resolved}\n{table}"
        # Where the official harness could not grade (patch did not apply), swectl reports an error too.
        assert (m == "error") == error, f"{name} {iid}: swectl {m}, official error={error}\n{table}"
    names = [n for n, *_ in table]
    assert names.count("gold") == 2
    assert any(r for *_, r, _ in table)
    assert not all(r for *_, r, _ in table)
