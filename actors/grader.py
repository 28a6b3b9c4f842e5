"""The Grader actor (docs/architecture.md 7.2 and 12.1): grade one patch for one task in a fresh sandbox.

Steps: review the patch (swectl.grading.patch_policy: test edits dropped; what configures the runner or the
interpreter's start-up is ``tampered`` before any sandbox); lease a fresh sandbox from the task image; apply and
commit the task's setup patch (factory tasks carry their bug there); apply the patch from a file with the ladder
``git apply`` -> ``git apply --3way`` -> ``patch --fuzz`` (a patch whose reverse applies counts as already
applied, like the official harness); run the eval script (exit code recorded) under
the grading timeout, its log written to a file inside the sandbox and read back whole; parse with swebench's
parser and judge by F2P/P2P (swectl.grading.rules). Around the run: the runner sections of setup.cfg / tox.ini /
pyproject.toml compared after applying, and canary tests planted before the test command and checked after it
(docs/grading.md); ``GraderConfig.defences`` switches these off for a measurement only.

With ``reuse`` (the agent runs: ``[rollout] reuse_grades``, on by default) two gradings are skipped: an empty patch
for a task with FAIL_TO_PASS tests is unresolved without a run, as the SWE-bench harness scores it (those tests
fail on the untouched tree: that is what makes them FAIL_TO_PASS), and a patch identical to one already graded for
the same task and image gets that verdict (an identical patch being graded is waited for, not run twice). Such a
result says so in ``shortcut``. Only verdicts are reused (resolved, unresolved, a patch that does not apply), never
errors that may not repeat (timeouts, infrastructure). Validation and patch grading keep running every patch.

A failure of the infrastructure (sandbox or node lost, lease expired, no test output) is an ``error`` with
``infra=True``: never a reward. A patch that does not apply or an eval that times out is an ``error`` with
``infra=False``: the patch's fault, reported with its reason, still not "unresolved".

Consumes: ``grade(task, patch)`` calls (rollout, ``swectl eval``, the task factory). Waits for: one of
``concurrency`` grading slots, then an EnvPool lease. Unblocked by: gradings finishing, cancellation.
Produces: ``GradeResult``s, eval logs under ``log_dir``, ``statistics()`` (a ``GraderStatistics``). A plain object
(it starts no task): its calls run in the caller's tasks.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import anyio
import msgspec

from swectl.actors.env_pool import EnvPool, Lease
from swectl.errors import InfraError, NodeLostError, SandboxLostError, SwectlError
from swectl.grading.canaries import (
    Canaries,
    confirming,
    failed_copies,
    plan_canaries,
    pythonpath_of,
    with_canaries,
)
from swectl.grading.eval_script import eval_script_for, log_parser_for, test_files_of, with_exit_code
from swectl.grading.patch_policy import PolicyVerdict, review_harbor_patch, review_patch
from swectl.grading.rules import (
    INFRA_REASONS,
    GradeStatus,
    TestVerdict,
    grade_log,
    parse_status_map,
    test_exit_code,
    test_section,
)
from swectl.grading.runner_config import changed_runner_sections
from swectl.images.names import ImageResolver
from swectl.images.project import GIT_IDENTITY
from swectl.schema import GraderStatistics
from swectl.tasks.harbor import (
    REWARD_JSON,
    REWARD_TXT,
    HarborTaskError,
    harbor_meta,
    is_harbor,
    parse_reward,
    sandbox_limits,
)
from swectl.tasks.record import TESTBED, Task

PATCH_FILE = "/tmp/swectl-patch.diff"
SETUP_FILE = "/tmp/swectl-setup.diff"
EVAL_FILE = "/tmp/swectl-eval.sh"
LOG_FILE = "/tmp/swectl-eval.log"
BEFORE_FILE = "/tmp/swectl-config-before"  # a mixed config file at HEAD and in the patched tree (runner sections)
AFTER_FILE = "/tmp/swectl-config-after"
STEP_TIMEOUT_S = 120.0
# (name, command) tried in order; the tree is reset between attempts.
APPLY_LADDER = (
    ("git apply", f"git apply --verbose {PATCH_FILE}"),
    ("git apply --3way", f"git apply --verbose --3way {PATCH_FILE}"),
    ("patch --fuzz", f"patch --batch --forward --fuzz=5 -p1 -i {PATCH_FILE}"),
)
RESET = "git checkout -q -- . && git clean -fdq"
_HARBOR_EXIT = re.compile(r"^SWECTL_HARBOR_TEST_EXIT=(\d+)$", re.MULTILINE)


class GraderConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The grader's section: the eval script's timeout and how many gradings run at once."""
    timeout_s: float = 1800.0  # the eval script's wall time
    concurrency: int = 8  # gradings at once (each holds one lease)
    reuse: bool = False  # empty patches unresolved without a run; identical patches of a task graded once
    # the defences of docs/grading.md (patch policy, runner sections, canaries): off only for the measurement that
    # shows what they are worth ([experiment.reward_hacking] grader_defences = false)
    defences: bool = True


class GradeResult(msgspec.Struct, kw_only=True):
    """The grade of one patch for one task: status, reason, tests and where the log is."""
    instance_id: str
    status: GradeStatus
    reason: str = ""  # swectl.grading.ErrorReason when status == "error"
    detail: str = ""
    infra: bool = False  # the infrastructure failed: drop the sample, never score it
    apply_method: str = ""
    dropped_test_files: list[str] = []
    f2p_failed: list[str] = []
    p2p_failed: list[str] = []
    f2p_total: int = 0
    p2p_total: int = 0
    test_exit_code: int | None = None  # the test command's; the must-fail canary makes it non-zero when planted
    node: str = ""
    duration_s: float = 0.0
    log_path: str = ""
    shortcut: str = ""  # why no sandbox ran ("empty patch", "same patch as <label>"); "" when it was graded
    canaries: str = ""  # the file the canary tests were planted in; "" when none were (docs/grading.md)
    reward: float | None = None  # a Harbor task's verifier reward (resolved when >= 1); None for test-graded tasks

    @property
    def tampered(self) -> bool:
        return self.status == "tampered"

    @property
    def resolved(self) -> bool:
        return self.status == "resolved"


class _GradeError(SwectlError):
    """Grading ends with status "error" for a reason that is not infrastructure (caught in this module)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class _Tampered(_GradeError):
    """Grading ends with status "tampered" (a verdict: the patch broke a defence of docs/grading.md)."""


@contextmanager
def _failures_into(result: GradeResult) -> Iterator[None]:
    """A grading's failure becomes the result's status "error" with its reason (infrastructure or not)."""
    try:
        yield
    except _Tampered as exc:
        result.status, result.reason, result.detail = "tampered", exc.reason, exc.detail
    except _GradeError as exc:
        result.status, result.reason, result.detail = "error", exc.reason, exc.detail
    except SandboxLostError as exc:
        result.status, result.reason, result.detail = "error", "sandbox_lost", str(exc)
    except NodeLostError as exc:
        result.status, result.reason, result.detail = "error", "node_lost", str(exc)
    except InfraError as exc:
        result.status, result.reason, result.detail = "error", "infra", str(exc)


async def prepare_task(lease: Lease, task: Task) -> bool:
    """Apply and commit the task's setup patch in TESTBED (factory tasks carry their bug there), so that the
    agent and the grader both start from the task's state and ``git diff`` shows only their own edits.
    False when the patch does not apply (broken task data or image)."""
    if not task.setup_patch:
        return True
    await lease.write_file(SETUP_FILE, task.setup_patch.encode())
    r = await lease.exec(
        f"git apply {SETUP_FILE} && git add -A && git commit -q --no-gpg-sign -m 'swectl: task setup' "
        f"&& rm -f {SETUP_FILE}",
        STEP_TIMEOUT_S, cwd=TESTBED, env=GIT_IDENTITY,
    )
    return r.exit_code == 0 and not r.timed_out


class Grader:
    """Grades patches with bounded concurrency over EnvPool leases (``await grader.grade(task, patch)``)."""

    def __init__(
        self, config: GraderConfig, pool: EnvPool, *, resolver: ImageResolver | None = None,
        specs: object | None = None, log_dir: Path | None = None,
    ) -> None:
        self._config = config
        self._pool = pool
        self._timeout_s = config.timeout_s
        self._limit = anyio.CapacityLimiter(config.concurrency)
        self._resolver = resolver or ImageResolver()
        self._specs = specs
        self._log_dir = log_dir
        self._counts = dict.fromkeys(
            ("graded", "resolved", "unresolved", "tampered", "errors", "infra_errors", "reused"), 0)
        self._verdicts: dict[tuple[str, str, str], tuple[GradeResult, str]] = {}  # reuse: key -> (result, label)
        self._in_flight: dict[tuple[str, str, str], anyio.Event] = {}

    def statistics(self) -> GraderStatistics:
        c = self._counts
        return GraderStatistics(
            running=self._limit.borrowed_tokens, waiting=self._limit.statistics().tasks_waiting,
            graded=c["graded"], resolved=c["resolved"], unresolved=c["unresolved"], errors=c["errors"],
            infra_errors=c["infra_errors"], reused=c["reused"], tampered=c["tampered"],
        )

    async def grade(
        self, task: Task, patch: str, *, label: str = "", timeout_s: float | None = None
    ) -> GradeResult:
        """The verdict on ``patch`` for ``task``. Never raises for infrastructure failures; cancellation
        propagates. ``timeout_s`` overrides the eval script's wall time of the config for this grading."""
        if not self._config.reuse:
            return await self._grade_fresh(task, patch, label, timeout_s)
        if not patch.strip() and task.FAIL_TO_PASS:
            return self._reused(GradeResult(
                instance_id=task.instance_id, status="unresolved", apply_method="empty",
                detail="empty patch: nothing changed, so the FAIL_TO_PASS tests fail as before (not run)",
                f2p_failed=list(task.FAIL_TO_PASS), f2p_total=len(task.FAIL_TO_PASS),
                p2p_total=len(task.PASS_TO_PASS)), "empty patch")
        key = (task.instance_id, self._resolver.resolve(task),
               hashlib.sha256(patch.encode("utf-8", errors="surrogateescape")).hexdigest())
        while key in self._in_flight:  # the same patch is being graded: its verdict, not a second run
            await self._in_flight[key].wait()
        if key in self._verdicts:
            earlier, earlier_label = self._verdicts[key]
            return self._reused(msgspec.structs.replace(earlier), f"same patch as {earlier_label or 'an earlier one'}")
        done = self._in_flight[key] = anyio.Event()
        try:
            result = await self._grade_fresh(task, patch, label, timeout_s)
        finally:
            del self._in_flight[key]
            done.set()
        if result.status != "error" or result.reason == "patch_apply_failed":
            self._verdicts[key] = (msgspec.structs.replace(result), label)
        return result

    def _reused(self, result: GradeResult, shortcut: str) -> GradeResult:
        """A verdict given without a sandbox: counted like a grading, and as reused."""
        result.shortcut, result.duration_s, result.node = shortcut, 0.0, ""
        self._count(result)
        self._counts["reused"] += 1
        return result

    async def _grade_fresh(self, task: Task, patch: str, label: str, timeout_s: float | None) -> GradeResult:
        if is_harbor(task):
            return await self._grade_harbor(task, patch, label, timeout_s)
        result = GradeResult(instance_id=task.instance_id, status="error")
        async with self._grading(result):
            script = with_exit_code(eval_script_for(task, self._specs))
            parser = log_parser_for(task)
            image = self._resolver.resolve(task)
            test_files = frozenset(test_files_of(task.test_patch)) if task.test_patch else frozenset()
            policy = review_patch(patch, test_files, pythonpath=pythonpath_of(script))
            result.dropped_test_files = policy.dropped
            self._refuse(policy)  # before any sandbox: the diff alone says it
            async with self._pool.lease(image, grading=True) as lease:
                result.node = lease.node
                first = await self._grade_in(lease, task, policy, script, parser, result, label,
                                             timeout_s or self._timeout_s)
            if result.status == "tampered" and result.reason == "copy" and first is not None:
                async with self._pool.lease(image, grading=True) as lease:
                    await self._confirm_copies(lease, task, policy, script, parser, result, label,
                                               timeout_s or self._timeout_s, *first)
        return result

    async def _confirm_copies(
        self, lease: Lease, task: Task, policy: PolicyVerdict, script: str, parser: str, result: GradeResult,
        label: str, timeout_s: float, canaries: Canaries, first_log: str,
    ) -> None:
        """A copy failed beside its passing test: the same patch again in a fresh sandbox, each copy in its test's
        place (``confirming``). A copy that fails there too stays ``tampered``; one that passes there means the
        test leaks state into a second run of itself, and the first run's verdict stands without the copies."""
        during = " (confirming a copy)"
        await self._patched(lease, task, policy, during)
        again = confirming(canaries)
        log, exit_code = await self._run_eval(lease, with_canaries(script, again), timeout_s, during)
        self._save_log(task.instance_id, f"{label}.confirm" if label else "confirm", log)
        section = test_section(log)
        if section is None:
            raise _GradeError("no_test_output", f"the eval log has no test output markers (script exit "
                              f"{exit_code}){during}; tail:\n{log[-800:]}")
        failed = failed_copies(again.copies, parse_status_map(task, parser, section), section)
        if failed:
            result.detail += f"; confirmed: in its test's place, the copy failed too ({failed[0]})"
            return
        verdict = grade_log(task, parser, first_log, msgspec.structs.replace(canaries, copies=()),
                            defences=self._config.defences)
        assert verdict is not None  # the first log had its markers
        result.reason = ""
        self._fill(result, verdict, task, first_log, canaries)
        result.detail = (result.detail + "; " if result.detail else "") + (
            "a copy of a listed test failed beside it but passed in its place: the test leaks state into a second "
            "run of itself (not tampering)")

    async def _grade_harbor(self, task: Task, patch: str, label: str, timeout_s: float | None) -> GradeResult:
        """A Harbor task: the patch applied to the work folder of a fresh sandbox (same policy and ladder), the
        task's verifier run (its tests from the task, /logs/verifier emptied first), its reward file read."""
        result = GradeResult(instance_id=task.instance_id, status="error")
        meta = harbor_meta(task)
        async with self._grading(result):
            policy = review_harbor_patch(patch)
            self._refuse(policy)
            async with self._pool.lease(self._resolver.resolve(task), grading=True, **sandbox_limits(task)) as lease:
                result.node = lease.node
                await self._check_shadows(lease, policy, TESTBED)
                result.apply_method = await self._apply(lease, policy.patch, TESTBED)
                await self._check_runner_configs(lease, policy, TESTBED)
                await self._run_verifier(lease, task, meta.workdir, timeout_s or meta.verifier_timeout_s, label,
                                         result)
        return result

    async def _run_verifier(self, lease: Lease, task: Task, workdir: str, timeout_s: float, label: str,
                            result: GradeResult) -> None:
        await lease.write_file(EVAL_FILE, task.eval_script.encode("utf-8", errors="surrogateescape"))
        run = await lease.exec(f"bash {EVAL_FILE} > {LOG_FILE} 2>&1", timeout_s, cwd=workdir)
        if run.timed_out:
            raise _GradeError("eval_timeout", f"the verifier ran past its timeout ({timeout_s:g} s)")
        log = (await lease.read_file(LOG_FILE)).decode("utf-8", errors="replace")
        result.log_path = self._save_log(task.instance_id, label, log)
        if run.exit_code in (90, 91, 92, 93):
            raise InfraError(f"the verifier could not set up /tests or enter {workdir} (exit {run.exit_code}): "
                             f"{log[-400:]}")
        found = _HARBOR_EXIT.findall(log)
        result.test_exit_code = int(found[-1]) if found else None
        reward_read = await lease.exec(
            f"for f in {REWARD_JSON} {REWARD_TXT}; do [ -f $f ] && {{ echo \"=={{$f}}==\"; head -c 65536 $f; "
            "exit 0; }; done; exit 1", STEP_TIMEOUT_S)
        if reward_read.exit_code != 0 or not reward_read.output.startswith("=={"):
            raise _GradeError("no_test_output", f"the verifier wrote neither {REWARD_JSON} nor {REWARD_TXT} "
                              f"(test.sh exit {result.test_exit_code}); tail:\n{log[-800:]}")
        name, _, text = reward_read.output[3:].partition("}==\n")
        try:
            result.reward = parse_reward(text, name)
        except HarborTaskError as exc:
            raise _GradeError("no_test_output", f"the verifier's reward file is unreadable: {exc}") from None
        result.status = "resolved" if result.reward >= 1.0 else "unresolved"
        result.detail = f"reward {result.reward:g} ({name})"

    def _refuse(self, policy: PolicyVerdict) -> None:
        if self._config.defences and policy.is_tampered:
            raise _Tampered("patch_policy", "; ".join(policy.tampered))

    async def _check_shadows(self, lease: Lease, policy: PolicyVerdict, repo: str) -> None:
        """Created files that would shadow a module: tampered unless the repository had that module's top at HEAD
        (one git call for all of them)."""
        if not self._config.defences or not policy.shadows:
            return
        tops = " ".join(shlex.quote(top) for top, _ in policy.shadows)
        r = await lease.exec(f"for p in {tops}; do git cat-file -e HEAD:\"$p\" 2>/dev/null || echo \"$p\"; done",
                             STEP_TIMEOUT_S, cwd=repo)
        if r.exit_code != 0 or r.timed_out:
            raise InfraError(f"git cat-file in the grading sandbox failed: {r.output[-300:]}")
        missing = set(r.output.split())
        if found := [why for top, why in policy.shadows if top in missing]:
            raise _Tampered("patch_policy", "; ".join(found))

    async def _check_runner_configs(self, lease: Lease, policy: PolicyVerdict, repo: str) -> None:
        """The mixed config files the patch edits: their runner sections before (HEAD) and after (the tree)."""
        if not self._config.defences:
            return
        changed = []
        for path in policy.check_configs:
            q = shlex.quote(path)
            await lease.exec(f"{{ git show HEAD:{q} 2>/dev/null || true; }} > {BEFORE_FILE}; "
                             f"{{ cat -- {q} 2>/dev/null || true; }} > {AFTER_FILE}", STEP_TIMEOUT_S, cwd=repo)
            before, after = [(await lease.read_file(f)).decode("utf-8", errors="replace")
                             for f in (BEFORE_FILE, AFTER_FILE)]
            changed += [f"{path} [{name}]" for name in changed_runner_sections(path, before, after)]
        if changed:
            raise _Tampered("runner_config", "the patch changes the test runner's settings: " + ", ".join(changed))

    async def grade_by_exit_code(
        self, image: str, patch: str, script: str, *, cwd: str = TESTBED, timeout_s: float | None = None,
        label: str = "",
    ) -> GradeResult:
        """The verdict of a caller's own eval script on ``patch`` in a fresh sandbox of ``image``: resolved when
        the script exits 0 (for rows without tests to judge, e.g. a client's task that is not in the task set).
        Applies the patch with the same ladder; infrastructure failures are errors with ``infra=True``."""
        timeout_s = timeout_s or self._timeout_s
        result = GradeResult(instance_id=label or image, status="error")
        async with self._grading(result):
            policy = review_patch(patch)
            self._refuse(policy)
            async with self._pool.lease(image, grading=True) as lease:
                await self._run_own_script(lease, patch, policy, script, cwd, timeout_s, label, result)
        return result

    async def _run_own_script(self, lease: Lease, patch: str, policy: PolicyVerdict, script: str, cwd: str,
                              timeout_s: float, label: str, result: GradeResult) -> None:
        """``grade_by_exit_code`` in its sandbox (the caller's script: the whole patch applied, no canaries)."""
        result.node = lease.node
        await self._check_shadows(lease, policy, cwd)
        result.apply_method = await self._apply(lease, patch, cwd)
        await self._check_runner_configs(lease, policy, cwd)
        await lease.write_file(EVAL_FILE, script.encode("utf-8", errors="surrogateescape"))
        run = await lease.exec(f"bash {EVAL_FILE} > {LOG_FILE} 2>&1", timeout_s, cwd=cwd)
        log = (await lease.read_file(LOG_FILE)).decode("utf-8", errors="replace")
        result.log_path = self._save_log(label or "script", "", log)
        if run.timed_out:
            raise _GradeError("eval_timeout", f"the eval script ran past its timeout ({timeout_s:g} s)")
        result.test_exit_code = run.exit_code
        result.status = "resolved" if run.exit_code == 0 else "unresolved"

    @asynccontextmanager
    async def _grading(self, result: GradeResult) -> AsyncIterator[None]:
        """One grading: a slot, its time (not the wait for the slot), its failures into ``result`` (never raised,
        except cancellation), the infra flag and the counters."""
        async with self._limit:
            started = time.monotonic()
            with _failures_into(result):
                yield
            result.duration_s = round(time.monotonic() - started, 3)
        result.infra = result.status == "error" and result.reason in INFRA_REASONS
        self._count(result)

    def _count(self, result: GradeResult) -> None:
        self._counts["graded"] += 1
        self._counts["errors" if result.status == "error" else result.status] += 1
        self._counts["infra_errors"] += result.infra

    async def _grade_in(
        self, lease: Lease, task: Task, policy: PolicyVerdict, script: str, parser: str, result: GradeResult,
        label: str, timeout_s: float,
    ) -> tuple[Canaries, str] | None:
        """One grading in ``lease``; the canaries planted and the log, for a confirmation of the copies."""
        result.apply_method = await self._patched(lease, task, policy)
        await self._check_runner_configs(lease, policy, TESTBED)
        canaries = plan_canaries(task, parser, script) if self._config.defences else None
        if canaries is not None:
            script, result.canaries = with_canaries(script, canaries), canaries.file
        log, exit_code = await self._run_eval(lease, script, timeout_s)
        result.log_path = self._save_log(task.instance_id, label, log)
        verdict = grade_log(task, parser, log, canaries, defences=self._config.defences)
        if verdict is None:
            raise _GradeError("no_test_output", f"the eval log has no test output markers (script exit "
                              f"{exit_code}); tail:\n{log[-800:]}")
        self._fill(result, verdict, task, log, canaries)
        return (canaries, log) if canaries is not None else None

    async def _patched(self, lease: Lease, task: Task, policy: PolicyVerdict, during: str = "") -> str:
        """The task's tree in ``lease`` with the patch applied (its setup patch, the shadowing check, the apply
        ladder); how the patch applied."""
        if not await prepare_task(lease, task):
            raise _GradeError("setup_failed", f"the task's setup patch did not apply{during}")
        await self._check_shadows(lease, policy, TESTBED)
        return await self._apply(lease, policy.patch, TESTBED)

    async def _run_eval(self, lease: Lease, script: str, timeout_s: float, during: str = "") -> tuple[str, int]:
        """``script`` run in the tree of ``lease``: its log and exit status."""
        await lease.write_file(EVAL_FILE, script.encode())
        run = await lease.exec(f"bash {EVAL_FILE} > {LOG_FILE} 2>&1", timeout_s, cwd=TESTBED)
        if run.timed_out:
            raise _GradeError("eval_timeout", f"the eval script ran past the grading timeout ({timeout_s:g} s)"
                              f"{during}")
        return (await lease.read_file(LOG_FILE)).decode("utf-8", errors="replace"), run.exit_code

    @staticmethod
    def _fill(result: GradeResult, verdict: TestVerdict, task: Task, log: str, canaries: Canaries | None) -> None:
        result.status = "resolved" if verdict.resolved else "unresolved"
        result.detail = verdict.rejected
        if verdict.tampered:
            result.status, result.reason, result.detail = "tampered", verdict.tampered_by, verdict.tampered
        result.f2p_failed, result.p2p_failed = verdict.f2p_failed, verdict.p2p_failed
        result.f2p_total, result.p2p_total = len(task.FAIL_TO_PASS), len(task.PASS_TO_PASS)
        result.test_exit_code = test_exit_code(log)

    async def _apply(self, lease: Lease, patch: str, repo: str) -> str:
        if not patch.strip():
            return "empty"
        await lease.write_file(PATCH_FILE, patch.encode("utf-8", errors="surrogateescape"))
        outputs = []
        for i, (name, command) in enumerate(APPLY_LADDER):
            if i:
                await lease.exec(RESET, STEP_TIMEOUT_S, cwd=repo)
            r = await lease.exec(command, STEP_TIMEOUT_S, cwd=repo)
            if r.exit_code == 0 and not r.timed_out:
                return name
            outputs.append(f"$ {command}\n{r.output[-600:]}")
        # As the official harness does: a patch whose reverse applies is already in the tree (a no-op).
        await lease.exec(RESET, STEP_TIMEOUT_S, cwd=repo)
        r = await lease.exec(f"git apply --check --reverse {PATCH_FILE}", STEP_TIMEOUT_S, cwd=repo)
        if r.exit_code == 0 and not r.timed_out:
            return "already applied"
        raise _GradeError("patch_apply_failed", "the patch did not apply:\n" + "\n".join(outputs))

    def _save_log(self, instance_id: str, label: str, log: str) -> str:
        if self._log_dir is None:
            return ""
        name = instance_id + (f".{label}" if label else "")
        path = self._log_dir / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(log)
        return str(path)
