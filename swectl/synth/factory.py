"""The task factory (``swectl tasks synth``): SWE-smith-style bugs from a real project's own tests.

For one project image: run the suite once under the function-coverage script to learn which functions the
tests call and which tests pass; sample mutants of covered functions (deterministic by seed); run the
suite on each mutant in a sandbox; keep a mutant when 1..max_fail tests that passed now fail and every
other test still passes. The failing tests are FAIL_TO_PASS, the rest PASS_TO_PASS, the bug diff becomes
the task's ``setup_patch`` and its reverse the gold ``patch``. The problem statement is written from the
failing tests' names and messages only, and is rejected if it quotes a changed source line.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Callable
from importlib import resources

import anyio
import msgspec

from swectl.actors.env_pool import EnvPool, Lease
from swectl.grading.rules import PASSING, parse_status_map
from swectl.images.project import VENV, BuiltImage, Project
from swectl.synth.mutate import Mutant, changed_lines, sample_mutants, unified_diff
from swectl.synth.statement import failures_from_pytest_log, leaks, write_problem_statement
from swectl.tasks.record import TESTBED, Task

LOG_PARSER = "parse_log_pytest"


def _coverage_script() -> bytes:
    return resources.files("swectl.remote.programs").joinpath("func_coverage.py").read_bytes()


class SynthConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How the task factory samples mutants and keeps tasks."""
    seed: int = 0
    per_function: int = 3  # mutants sampled per covered function
    max_fail: int = 30  # keep a mutant only if 1..max_fail tests break
    max_tasks: int = 10  # per project
    max_candidates: int = 80  # mutants tried per project (in seed order)
    concurrency: int = 2
    test_timeout_s: float = 20.0  # the bundled suites take ~1 s; a mutant that loops is cut here


class SynthStats(msgspec.Struct, kw_only=True):
    """Counts of one factory run on one project, from baseline tests to kept tasks."""
    project: str
    baseline_passing: int = 0
    covered_functions: int = 0
    candidates: int = 0
    kept: int = 0
    rejected: dict[str, int] = {}


def factory_eval_script(project: Project) -> str:
    """The eval script of a factory task: reset the test files, run the suite between markers."""
    tests = " ".join(shlex.quote(t) for t in project.tests)
    return "\n".join([
        "#!/bin/bash",
        "set -uxo pipefail",
        f"source {VENV}/bin/activate",
        f"cd {TESTBED}",
        f"git checkout -q HEAD -- {tests}",
        "echo '>>>>> Start Test Output'",
        project.test_command(),
        "echo '>>>>> End Test Output'",
        f"git checkout -q HEAD -- {tests}",
        "",
    ])


def _task_for(project: Project, built: BuiltImage, mutant: Mutant, failing: list[str], passing: list[str],
              statement: str) -> Task:
    bug = unified_diff(mutant.path, mutant.original, mutant.mutated)
    digest = hashlib.sha256(bug.encode()).hexdigest()[:8]
    return Task(
        instance_id=f"{project.name}__{project.name}-{project.version}.{digest}",
        repo=project.repo,
        problem_statement=statement,
        FAIL_TO_PASS=failing,
        PASS_TO_PASS=passing,
        base_commit=built.base_commit,
        patch=unified_diff(mutant.path, mutant.mutated, mutant.original),
        version=project.version,
        image=project.image,
        eval_script=factory_eval_script(project),
        log_parser=LOG_PARSER,
        eval_type="pass_and_fail",
        setup_patch=bug,
        source="swectl-synth",
        extra={"synth": {"kind": mutant.kind, "function": mutant.function, "path": mutant.path,
                         "line": mutant.line}},
    )


class _Baseline(msgspec.Struct):
    passing: list[str]
    covered: dict[str, list[str]]  # source path -> covered function qualnames


async def _run_suite(lease: Lease, project: Project, cfg: SynthConfig) -> str:
    cmd = f"source {VENV}/bin/activate && {project.test_command()} > /tmp/swectl-synth.log 2>&1"
    r = await lease.exec(cmd, cfg.test_timeout_s, cwd=TESTBED)
    if r.timed_out:
        return ""
    return (await lease.read_file("/tmp/swectl-synth.log")).decode("utf-8", errors="replace")


def _status(project: Project, log: str) -> dict[str, str]:
    probe = Task(instance_id=project.name, repo=project.repo, problem_statement="", FAIL_TO_PASS=[])
    return parse_status_map(probe, LOG_PARSER, log)


def _whole_id(test_id: str) -> bool:
    """swebench's pytest parser cuts ids at the first space (``test_x[a b]`` becomes ``test_x[a``); such
    ids are kept out of FAIL_TO_PASS / PASS_TO_PASS so that every listed id names exactly one test."""
    return test_id.count("[") == test_id.count("]")


async def _baseline(lease: Lease, project: Project, cfg: SynthConfig) -> _Baseline:
    log = await _run_suite(lease, project, cfg)
    status = _status(project, log)
    passing = sorted(t for t, s in status.items() if s in PASSING and _whole_id(t))
    await lease.write_file("/tmp/func_coverage.py", _coverage_script())
    args = " ".join(shlex.quote(t) for t in project.tests)
    r = await lease.exec(
        f"source {VENV}/bin/activate && PYTHONPATH={project.pythonpath} python /tmp/func_coverage.py "
        f"--root {TESTBED} --out /tmp/cov.json -- -q -p no:cacheprovider {args} > /tmp/cov.log 2>&1",
        cfg.test_timeout_s * 3, cwd=TESTBED,
    )
    if r.timed_out:
        raise RuntimeError(f"{project.name}: coverage run timed out")
    cov = json.loads(await lease.read_file("/tmp/cov.json"))
    covered: dict[str, set[str]] = {}
    for info in cov["tests"].values():
        for path, qualname, _line in info["functions"]:
            if path in project.sources:
                covered.setdefault(path, set()).add(qualname)
    return _Baseline(passing, {p: sorted(q) for p, q in covered.items()})


async def _candidates(lease: Lease, project: Project, base: _Baseline, cfg: SynthConfig) -> list[Mutant]:
    out: list[Mutant] = []
    for i, path in enumerate(sorted(base.covered)):
        source = (await lease.read_file(f"{TESTBED}/{path}")).decode()
        out.extend(sample_mutants(source, path, base.covered[path], seed=cfg.seed * 1000 + i,
                                  per_function=cfg.per_function))
    # Interleave files deterministically so a small budget still spreads over the project.
    import random

    random.Random(f"{project.name}:{cfg.seed}").shuffle(out)
    return out[: cfg.max_candidates]


class _Outcome(msgspec.Struct):
    index: int
    verdict: str  # "keep" or a rejection reason
    failing: list[str] = []
    statement: str = ""


async def _try_mutant(lease: Lease, project: Project, base: _Baseline, mutant: Mutant, index: int,
                      cfg: SynthConfig) -> _Outcome:
    await lease.exec("git checkout -q -- . && git clean -fdq", 60, cwd=TESTBED)
    await lease.write_file(f"{TESTBED}/{mutant.path}", mutant.mutated.encode())
    log = await _run_suite(lease, project, cfg)
    if not log:
        return _Outcome(index, "timeout")
    status = _status(project, log)
    failing = [t for t in base.passing if status.get(t) not in PASSING]
    if any(not _whole_id(t) and s not in PASSING for t, s in status.items()):
        return _Outcome(index, "breaks_unlisted_tests")  # a test whose id the parser truncates broke
    if not failing:
        return _Outcome(index, "no_test_fails")
    if len(failing) > cfg.max_fail:
        return _Outcome(index, "too_many_fail")
    # Sorted: test order can vary between runs (parametrize over a set, string hashing is salted).
    failures = sorted((f for f in failures_from_pytest_log(log) if f.test_id in set(failing)),
                      key=lambda f: f.test_id)
    statement = write_problem_statement(project.name, failures, seed=cfg.seed + index)
    # Removed and added lines: a removed statement is the answer as much as a changed one.
    if leaks(statement, changed_lines(mutant.original, mutant.mutated)):
        return _Outcome(index, "statement_leaks")
    return _Outcome(index, "keep", failing, statement)


async def synth_project(
    pool: EnvPool, project: Project, built: BuiltImage, cfg: SynthConfig, say: Callable[[str], None] = print
) -> tuple[list[Task], SynthStats]:
    stats = SynthStats(project=project.name)
    async with pool.lease(project.image) as lease:
        base = await _baseline(lease, project, cfg)
        candidates = await _candidates(lease, project, base, cfg)
    stats.baseline_passing = len(base.passing)
    stats.covered_functions = sum(len(v) for v in base.covered.values())
    stats.candidates = len(candidates)
    say(f"{project.name}: {len(base.passing)} tests pass, {stats.covered_functions} covered functions, "
        f"{len(candidates)} candidate mutants")
    outcomes: list[_Outcome] = []
    queue = list(enumerate(candidates))

    in_flight: set[int] = set()

    def enough() -> bool:
        """Whether the first max_tasks keepers are already known: every candidate before the next
        unfinished one is done, and they hold max_tasks keepers of distinct functions. Stopping here
        gives the same tasks as trying every candidate (deterministic), at a fraction of the cost."""
        pending = [i for i, _ in queue] + sorted(in_flight)
        frontier = min(pending) if pending else len(candidates)
        keepers = {(candidates[o.index].path, candidates[o.index].function)
                   for o in outcomes if o.verdict == "keep" and o.index < frontier}
        return len(keepers) >= cfg.max_tasks

    async def worker() -> None:
        async with pool.lease(project.image) as lease:
            while queue and not enough():
                index, mutant = queue.pop(0)
                in_flight.add(index)
                try:
                    outcomes.append(await _try_mutant(lease, project, base, mutant, index, cfg))
                finally:
                    in_flight.discard(index)

    async with anyio.create_task_group() as tg:
        for _ in range(min(cfg.concurrency, len(candidates))):
            tg.start_soon(worker)
    tasks: list[Task] = []
    used_functions: set[tuple[str, str]] = set()
    for out in sorted(outcomes, key=lambda o: o.index):
        mutant = candidates[out.index]
        verdict = out.verdict
        if verdict == "keep" and (mutant.path, mutant.function) in used_functions:
            verdict = "function_already_used"
        if verdict != "keep" or len(tasks) >= cfg.max_tasks:
            stats.rejected[verdict if verdict != "keep" else "over_budget"] = (
                stats.rejected.get(verdict if verdict != "keep" else "over_budget", 0) + 1)
            continue
        used_functions.add((mutant.path, mutant.function))
        passing = sorted(set(base.passing) - set(out.failing))
        tasks.append(_task_for(project, built, mutant, sorted(out.failing), passing, out.statement))
    stats.kept = len(tasks)
    say(f"{project.name}: kept {len(tasks)} tasks; rejected {stats.rejected}")
    return tasks, stats
