"""The Grader on the bundled tasks with real Podman sandboxes: gold and empty patches, bad patches of every
kind, eval timeouts, logs that claim success, and a sandbox lost mid-grading."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig, GradeResult
from swectl.config import load_config
from swectl.images.project import BUNDLED_TASKS
from swectl.remote.nodes.podman import bundled_containers_conf
from swectl.sandbox import LABEL_RUN
from swectl.tasks.record import Task
from swectl.tasks.sources import load_tasks
from swectl.testing import nodes as testnodes

from .conftest import STARTED_MARK, apodman, wait_for_file

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = bundled_containers_conf()


def podman(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}
    return subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=120, check=False)


def bundled() -> list[Task]:
    return load_tasks(BUNDLED_TASKS, strict=True).tasks


def one_per_project() -> list[Task]:
    seen: dict[str, Task] = {}
    for t in bundled():
        seen.setdefault(t.repo, t)
    return list(seen.values())


@pytest.fixture
def task() -> Task:
    """A bundled task whose bug lives in a single source file (every factory task)."""
    return bundled()[0]


@pytest.fixture
def run_id() -> str:
    rid = "g" + uuid.uuid4().hex[:12]
    yield rid
    ids = podman("ps", "-a", "-q", "--filter", f"label={LABEL_RUN}={rid}").stdout.split()
    if ids:
        podman("rm", "-f", "-t", "0", *ids)


async def grade(task: Task, patch: str, run_id: str, **kw) -> GradeResult:
    config = load_config(None, ["env_pool.warm=0", "sandbox.backend='podman'"])  # tests kill containers
    async with running_pool(config, run_id) as pool, anyio.create_task_group() as tg:
        grader = Grader(GraderConfig(**kw), pool)
        result = await grader.grade(task, patch)
        tg.cancel_scope.cancel()
    return result


def bug_file(task: Task) -> str:
    line = next(ln for ln in task.patch.splitlines() if ln.startswith("+++ b/"))
    return line[len("+++ b/"):]


def new_file_patch(path: str, content: str) -> str:
    lines = content.splitlines()
    body = "".join(f"+{ln}\n" for ln in lines)
    return (f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n{body}")


def git_diff_of(tmp: Path, files: dict[str, bytes]) -> str:
    """A real `git diff --binary` that adds ``files`` (made with git on the host)."""
    subprocess.run(["git", "init", "-q", str(tmp)], check=True)
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    subprocess.run(["git", "-C", str(tmp), "add", "-A"], check=True)
    return subprocess.run(["git", "-C", str(tmp), "diff", "--cached", "--binary"], check=True,
                          capture_output=True).stdout.decode()


# ------------------------------------------------------------------------------------------ verdicts


@pytest.mark.parametrize("project_task", one_per_project(), ids=lambda t: t.repo)
async def test_gold_resolves_empty_does_not(project_task: Task, run_id: str) -> None:
    gold = await grade(project_task, project_task.patch, run_id)
    assert gold.status == "resolved", gold
    assert gold.apply_method == "git apply"
    assert gold.canaries  # planted: the must-fail canary makes the command exit 1
    assert gold.test_exit_code == 1
    empty = await grade(project_task, "", run_id)
    assert empty.status == "unresolved", empty
    assert empty.f2p_failed == project_task.FAIL_TO_PASS
    assert not empty.p2p_failed
    assert not empty.infra


async def test_reuse_grades_each_distinct_patch_once(task: Task, run_id: str) -> None:
    """GraderConfig.reuse ([rollout] reuse_grades): identical patches of a task get one sandbox run (a copy being
    graded is waited for), an empty patch is unresolved without one, as a real run of it says (the test above);
    a timeout is no verdict and is not reused."""
    config = load_config(None, ["env_pool.warm=0", "sandbox.backend='podman'"])
    async with running_pool(config, run_id) as pool, anyio.create_task_group() as tg:
        grader = Grader(GraderConfig(reuse=True), pool)
        results: dict[str, GradeResult] = {}

        async def one(name: str, patch: str) -> None:
            results[name] = await grader.grade(task, patch, label=name)

        async with anyio.create_task_group() as both:
            both.start_soon(one, "first", task.patch)
            both.start_soon(one, "second", task.patch)
        await one("third", task.patch)
        await one("empty", "")
        await one("broken", "not a diff\n")
        await one("broken again", "not a diff\n")
        slow = [await grader.grade(task, task.patch + " ", label="slow", timeout_s=0.01) for _ in range(2)]
        stats = grader.statistics()
        tg.cancel_scope.cancel()
    gold = [results[k] for k in ("first", "second", "third")]
    assert all(r.status == "resolved" for r in gold), gold
    assert sorted(r.shortcut for r in gold)[0] == "" and sum(r.shortcut == "" for r in gold) == 1
    ran = next(r for r in gold if not r.shortcut)
    assert all(r.shortcut.startswith("same patch as ") and r.duration_s == 0.0 for r in gold if r is not ran)
    assert all(r.f2p_failed == ran.f2p_failed and r.log_path == ran.log_path for r in gold)
    empty = results["empty"]
    assert (empty.status, empty.shortcut, empty.apply_method) == ("unresolved", "empty patch", "empty")
    assert empty.f2p_failed == task.FAIL_TO_PASS and not empty.infra
    assert results["broken"].reason == results["broken again"].reason == "patch_apply_failed"
    assert results["broken again"].shortcut == "same patch as broken"
    assert [r.reason for r in slow] == ["eval_timeout", "eval_timeout"] and [r.shortcut for r in slow] == ["", ""]
    assert (stats.graded, stats.reused, stats.resolved) == (8, 4, 3)


async def test_malformed_patch_is_an_error_not_unresolved(task: Task, run_id: str) -> None:
    r = await grade(task, "this is not a diff\n@@ nonsense @@\n", run_id)
    assert (r.status, r.reason, r.infra) == ("error", "patch_apply_failed", False)
    assert "git apply" in r.detail
    assert "patch --batch" in r.detail


async def test_patch_against_missing_file_is_an_error(task: Task, run_id: str) -> None:
    bad = task.patch.replace(bug_file(task), "no/such/file.py")
    r = await grade(task, bad, run_id)
    assert (r.status, r.reason) == ("error", "patch_apply_failed")


async def test_binary_file_in_patch_applies(task: Task, run_id: str, tmp_path: Path) -> None:
    blob = bytes(range(256)) * 64 + b"\x00\xff"
    binary = git_diff_of(tmp_path, {"assets/logo.bin": blob})
    assert "GIT binary patch" in binary
    r = await grade(task, task.patch + binary, run_id)
    assert r.status == "resolved", r


async def test_edits_to_tests_are_reverted(task: Task, run_id: str) -> None:
    """A patch that 'fixes' the failures by deleting the failing tests' file gets no credit."""
    test_file = task.FAIL_TO_PASS[0].split("::")[0]
    cheat = (f"diff --git a/{test_file} b/{test_file}\ndeleted file mode 100644\n--- a/{test_file}\n+++ /dev/null\n"
             "@@ -1 +0,0 @@\n-placeholder\n")
    r = await grade(task, cheat, run_id)
    assert test_file in r.dropped_test_files
    assert r.status == "unresolved"
    assert r.apply_method == "empty"
    # The gold patch plus a new test file: the test file is dropped, the fix still counts.
    helper = new_file_patch("tests/test_extra_by_agent.py", "def test_x():\n    assert False\n")
    r = await grade(task, task.patch + helper, run_id)
    assert r.status == "resolved"
    assert r.dropped_test_files == ["tests/test_extra_by_agent.py"]


async def test_20_mb_patch(task: Task, run_id: str) -> None:
    big = "\n".join(f"line {i:09d} " + "x" * 60 for i in range(290_000)) + "\n"
    patch = task.patch + new_file_patch("data/big.txt", big)
    assert len(patch) > 20_000_000
    r = await grade(task, patch, run_id, timeout_s=300)
    assert r.status == "resolved", r


async def test_crlf_patch_falls_down_the_ladder(task: Task, run_id: str) -> None:
    r = await grade(task, task.patch.replace("\n", "\r\n"), run_id)
    assert r.status == "resolved", r
    assert r.apply_method != "git apply"


def image_file(task: Task, path: str) -> bytes:
    out = subprocess.run(["podman", "run", "--rm", "--network", "none", task.image, "cat", f"/testbed/{path}"],
                         capture_output=True, env={**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)},
                         timeout=120, check=True)
    return out.stdout


def deletion_patch(task: Task, path: str, tmp: Path) -> str:
    """A real `git diff` deleting ``path`` from the task's tree (the bug applied), made with git on the host."""
    git_diff_of(tmp, {path: image_file(task, path)})
    subprocess.run(["git", "-C", str(tmp), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"],
                   check=True)
    if task.setup_patch and path == bug_file(task):
        subprocess.run(["git", "-C", str(tmp), "apply", "-"], input=task.setup_patch.encode(), check=True)
        subprocess.run(["git", "-C", str(tmp), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam",
                        "bug"], check=True)
    subprocess.run(["git", "-C", str(tmp), "rm", "-q", path], check=True)
    return subprocess.run(["git", "-C", str(tmp), "diff", "--cached"], check=True, capture_output=True).stdout.decode()


async def test_deleting_files(task: Task, run_id: str, tmp_path: Path) -> None:
    # Deleting the module the tests import: applies, tests fail.
    r = await grade(task, deletion_patch(task, bug_file(task), tmp_path / "a"), run_id)
    assert (r.status, r.apply_method) == ("unresolved", "git apply"), r
    # Deleting an unrelated file next to the gold fix: still resolved.
    readme = next(n for n in ("README.rst", "README.md", "LICENSE") if image_file(task, n))
    r = await grade(task, task.patch + deletion_patch(task, readme, tmp_path / "b"), run_id)
    assert r.status == "resolved", r


def hanging_pytest(seconds: int, task: Task) -> str:
    """A patch that makes the tests hang as they import the code under test: lines at the end of the task's bug
    file sleep. They create STARTED_MARK first, so that a test can wait for the hang (`wait_hanging`)."""
    path = bug_file(task)
    lines = image_file(task, path).decode().splitlines()
    sleep = ["import pathlib, time  # noqa", f"pathlib.Path({STARTED_MARK!r}).touch()", f"time.sleep({seconds})"]
    return (f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -{len(lines)},1 +{len(lines)},4 @@\n"
            f" {lines[-1]}\n" + "".join(f"+{ln}\n" for ln in sleep))


async def test_eval_timeout_is_an_error(task: Task, run_id: str) -> None:
    r = await grade(task, hanging_pytest(600, task), run_id, timeout_s=8)
    assert (r.status, r.reason, r.infra) == ("error", "eval_timeout", False), r


async def test_log_claiming_success_while_tests_fail_is_rejected(task: Task, run_id: str) -> None:
    """A patch that prints PASSED lines for every listed test and makes pytest exit non-zero."""
    fake = "\n".join(f"print('PASSED {t}')" for t in task.FAIL_TO_PASS + task.PASS_TO_PASS)
    plugin = new_file_patch("fake_plugin.py", f"import os\n{fake}\nos._exit(3)\n")
    r = await grade(task, task.patch + plugin + new_file_patch("pytest.ini", "[pytest]\naddopts = -p fake_plugin\n"),
                    run_id)
    assert (r.status, r.reason) == ("tampered", "patch_policy"), r  # pytest.ini and os._exit: refused unrun
    assert "pytest.ini" in r.detail and not r.node
    # With the defences off (a measurement only), the older rule still rejects the log.
    r = await grade(task, task.patch + plugin + new_file_patch("pytest.ini", "[pytest]\naddopts = -p fake_plugin\n"),
                    run_id, defences=False)
    assert r.status == "unresolved", r
    assert r.test_exit_code == 3
    assert "exited 3" in r.detail


async def wait_hanging(run_id: str) -> str:
    """The container of this run once pytest hangs in it (the sleepy plugin's mark exists); bounded."""
    with anyio.fail_after(60):
        while True:
            ids = (await apodman("ps", "-q", "--filter", f"label={LABEL_RUN}={run_id}")).stdout.decode().split()
            if ids:
                await wait_for_file(ids[0])
                return ids[0]
            await anyio.sleep(0.25)


async def test_sandbox_lost_mid_grading_is_infra(task: Task, run_id: str) -> None:
    patch = hanging_pytest(30, task)

    async def kill_soon() -> None:
        await apodman("rm", "-f", "-t", "0", await wait_hanging(run_id))

    async with anyio.create_task_group() as tg:
        tg.start_soon(kill_soon)
        r = await grade(task, patch, run_id, timeout_s=120)
    assert r.status == "error", r
    assert r.infra, r
    assert r.reason in ("sandbox_lost", "infra"), r


@pytest.fixture
def sshd_node() -> Iterator[testnodes.TestNodes]:
    """One sshd test node in a network namespace, set up and torn down outside the event loop (it blocks)."""
    reason = testnodes.can_run_test_nodes()
    if reason is not None:
        pytest.skip(reason)
    with testnodes.test_nodes(1, prefix="swg", base_index=230) as started:
        yield started


async def test_node_lost_mid_grading_is_infra(task: Task, run_id: str, sshd_node: testnodes.TestNodes) -> None:
    """An sshd test node (network namespace) dies while its sandbox runs the eval script."""
    import tomllib

    from swectl.config import decode_config

    tn = sshd_node
    (node,) = tn.nodes
    doc = tomllib.loads(tn.cluster_toml(
        local=False, extra_node_fields="connect_timeout_s = 3\nkeepalive_interval_s = 1\nkeepalive_count_max = 2"))
    doc["env_pool"] = {"warm": 0, "health_interval_s": 0.5}
    doc["sandbox"] = {"backend": "podman"}
    config = decode_config(doc)

    async def kill_soon() -> None:
        await wait_hanging(run_id)
        await anyio.to_thread.run_sync(node.kill_sshd)

    try:
        async with running_pool(config, run_id) as pool, anyio.create_task_group() as tg:
            grader = Grader(GraderConfig(timeout_s=120), pool)
            tg.start_soon(kill_soon)
            with anyio.fail_after(90):
                r = await grader.grade(task, hanging_pytest(60, task))
            tg.cancel_scope.cancel()
    finally:
        await anyio.to_thread.run_sync(node.restart_sshd)
    assert r.status == "error", r
    assert r.infra, r
    assert r.reason in ("node_lost", "sandbox_lost", "infra"), r
