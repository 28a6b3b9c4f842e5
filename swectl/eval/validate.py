"""``swectl tasks validate``: which rows of a task set an environment can be trusted for, and why not the others.

Per task: its image (built from the repo cache for classic SWE-bench rows, ``--repo-cache``; else the image the
row or ``--image-map`` names), then the gold patch graded ``runs`` times and the empty patch once, each in a fresh
sandbox. A task is **validated** when its image exists, gold resolves in every run and empty does not. Every other
task gets exactly one reason (:func:`classify`, first match wins):

- ``build_failed``: the image did not build; ``step`` says where (images/instance.py's BUILD_STEPS);
- ``infra``: a grading never got a verdict (sandbox or node lost): not the task's fault, run again;
- ``timeout``: gold's tests ran past the grading timeout;
- ``gold_patch_failed``: the gold patch did not apply;
- ``flaky``: gold resolved in some runs and not in others; ``tests`` are the ones that changed;
- ``network``: gold's failing tests need the network (the log has resolver / connection errors; sandboxes
  have none);
- ``gold_tampered``: the grader's defences (docs/grading.md) called the gold patch tampered in every run: a false
  positive of theirs, with their reason in the detail;
- ``cpu_count``: gold's failing tests depend on the number of CPUs (parallel jobs, ``cpu_count``, tests skipped
  for want of cores): the official harness sets no CPU limit; ``--set sandbox.grading_cpus=N`` gives gradings N
  cores (0: no limit, which tools that read cgroup v1's ``cpu.shares``, as pylint does, count as one core);
- ``missing_library``: gold fails the same tests every run and the log says a C library is missing (``ecCodes
  library not found``, ``cannot open shared object file``): a system library the official (conda) environment
  brings; when the build skipped its apt steps, the detail says to build with ``--allow-network``;
- ``missing_dependency``: the same, and the tests could not import a module (``No module named``): a dependency
  the environment lacks; the detail names it and says whether the gold or the test patch imports it (a dependency
  the fix adds, which the official image, built at the environment setup commit, has);
- ``other_python``: the same, and the image runs another Python than the spec's (none of it offline on the node:
  the base image's 3.11, or the nearest newer one the node has); the detail quotes the build's warning;
- ``env_drift``: gold fails the same tests every run, nothing is missing: the environment differs from the one the
  dataset's test lists were recorded in (a newer package changing behaviour; ``tests`` names them; deprecation warnings
  raised as errors are named in the detail);
- ``empty_resolves``: the empty patch resolves: the tests do not see the bug (the detail says when the image runs
  another Python than the spec's, under which the dataset recorded the failure).

Outputs in ``--out``: ``grades.jsonl`` (every grading as it finishes: a rerun with the same ``--out`` grades only
what is missing, or was graded on an image since rebuilt), ``verdicts.jsonl`` (each task's verdict as it is made),
``validation.json`` (a ValidationReport: per task, per repository, per (repository, version) environment and in
all), ``validated.txt`` (the ids), ``image-map.json`` (instance_id -> image of the built ones). The last three are
rewritten as each task finishes, so a long run can be looked at (or cross-checked) while it goes on.

Coverage of a large set in the disk of one machine (``--per-version N --prune``): :func:`pick_per_version` takes N
rows of every environment, grouped so that an environment's rows are built one after another; with ``prune`` each
image this ``--out`` built (``built.txt``) is removed once its task's verdict is made, and the environment's own
images once its last task's verdict is, at most ``jobs + 1`` images wait for their gradings, and a rerun with the
same ``--out`` keeps the verdicts already made (their images are gone) instead of building them again; a verdict of
``infra`` or ``build_failed`` (a full disk, a download that failed, a fix to the builder) is made again.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal, TypeVar

import anyio
import msgspec

from swectl.actors.env_pool import running_pool
from swectl.actors.grader import Grader, GraderConfig, GradeResult
from swectl.config import ClusterConfig
from swectl.data.prepare import is_eval_set
from swectl.eval.progress import Progress
from swectl.images.instance import SUBSTITUTED_PYTHON, InstanceOutcome
from swectl.images.names import ImageResolver
from swectl.images.project import image_id
from swectl.tasks.record import Task

VALIDATION_FORMAT = 1
Reason = Literal["build_failed", "infra", "timeout", "gold_patch_failed", "gold_tampered", "flaky", "network",
                 "cpu_count", "missing_library", "missing_dependency", "other_python", "env_drift", "empty_resolves"]
GradeKind = Literal["gold", "empty"]
RecordT = TypeVar("RecordT", bound=msgspec.Struct)

# What a test log says when a test wanted the network (sandboxes run with none).
NETWORK_MARKERS = re.compile(
    r"Temporary failure in name resolution|Name or service not known|Network is unreachable|"
    r"Failed to establish a new connection|Could not resolve host|getaddrinfo failed|"
    r"No address associated with hostname|nodename nor servname provided|urlopen error|Max retries exceeded with url",
    re.IGNORECASE,
)
# Test ids and log lines of tests whose outcome depends on how many CPUs the sandbox has.
CPU_TESTS = re.compile(r"parallel|multiprocess|jobs|cpu_count|n_cpu|ncpu", re.IGNORECASE)
# (pylint skips its parallel tests with "Need 2 or more cores for test to be meaningful" in a one-CPU sandbox)
CPU_LOG = re.compile(r"\bcpu_count\b|sched_getaffinity|PYTEST_XDIST_AUTO_NUM_WORKERS|"
                     r"\b(?:\d+|two) or more (?:cores|cpus)\b|needs?_two_cores", re.IGNORECASE)
# A test skipped or failed on an import (pytest.importorskip, ImportError): the module is not in the environment.
MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")
# What a test log says when a C library is missing: the library's name in the first group that matched.
MISSING_LIBRARY = re.compile(
    r"([\w.+-]+\.so[\w.]*): cannot open shared object file|(\w+) library not found|cannot load library '([^']+)'|"
    r"Library not loaded: (\S+)|Could not find (?:the )?(\w+) (?:shared )?library", re.IGNORECASE)
# A deprecation warning raised as an error (a repository's conftest can turn them all into errors, as astropy's
# enable_deprecations_as_exceptions does): pytest's "E   <Category>: <message>" line; the category, the message.
DEPRECATION_ERROR = re.compile(r"^E\s+(?:[\w.]+\.)?(\w*(?:Deprecation|RemovedIn\d+)Warning): (.+)$", re.MULTILINE)
LOG_TAIL_BYTES = 4 << 20  # of a test log read for markers
RETRIED_ON_RESUME = ("infra", "build_failed")  # the verdicts a rerun makes again (with prune; the rest stand)


class GradeRecord(msgspec.Struct, kw_only=True):
    """One line of grades.jsonl: one grading of one patch for one task."""

    instance_id: str
    kind: GradeKind
    run: int  # 0.. for gold, 0 for empty
    image: str
    result: GradeResult
    image_id: str = ""  # the local image's id when graded ("" when it is not on this machine)


class InstanceValidation(msgspec.Struct, kw_only=True):
    """The verdict on one task: validated, or the one reason it is not."""

    instance_id: str
    repo: str
    version: str
    valid: bool
    reason: Reason | None = None
    step: str = ""  # build_failed: the build step (BUILD_STEPS)
    tests: list[str] = []  # the tests behind the reason (failing in every gold run, or flaky)
    detail: str = ""
    image: str = ""
    build: str = ""  # built / cached / failed / skipped / prebuilt (the row's or --image-map's image)
    build_s: float = 0.0
    gold: list[str] = []  # each gold run's status
    empty: str = ""
    grade_s: float = 0.0  # the gradings' time (gold runs and empty), summed
    logs: list[str] = []


class RepoValidation(msgspec.Struct, kw_only=True):
    """Per repository: how many tasks, built, gold resolved (every run), empty resolved, validated."""

    instances: int = 0
    built: int = 0
    gold_resolved: int = 0
    empty_resolved: int = 0
    validated: int = 0
    built_frac: float = 0.0
    gold_resolved_frac: float = 0.0  # of the built
    empty_resolved_frac: float = 0.0  # of the built
    reasons: dict[str, int] = {}
    seconds_per_task: float = 0.0  # build plus gradings (summed: gradings run side by side), mean over the tasks


class ValidationReport(msgspec.Struct, kw_only=True):
    """validation.json."""

    format_version: int = VALIDATION_FORMAT
    tasks: str
    eval_only: bool = False  # the source is an evaluation set (SWE-bench Verified): never train on these rows
    runs: int
    total: int
    validated: int
    reasons: dict[str, int]
    overall: RepoValidation
    repos: dict[str, RepoValidation]
    elapsed_s: float
    versions: dict[str, RepoValidation] = {}  # per environment, keyed "<repo> <version>" (environment_key)
    instances: list[InstanceValidation]


def environment_key(task: Task | InstanceValidation) -> str:
    """A task's environment as the report names it: ``"<repo> <version>"`` (SWE-bench's unit of environment)."""
    return f"{task.repo} {task.version}"


def pick_per_version(tasks: list[Task], n: int) -> list[Task]:
    """Up to ``n`` tasks of every (repo, version) environment, spread over its tasks in instance-id order (the
    same file gives the same picks, so a rerun resumes the same set), grouped by environment."""
    if n < 1:
        raise ValueError(f"per-version count must be at least 1, got {n}")
    groups: dict[str, list[Task]] = {}
    for task in sorted(tasks, key=lambda t: t.instance_id):
        groups.setdefault(environment_key(task), []).append(task)
    picked: list[Task] = []
    for key in sorted(groups):
        rows = groups[key]
        picked += [rows[i * len(rows) // n] for i in range(min(n, len(rows)))]
    return picked


def _failed_tests(result: GradeResult) -> set[str]:
    return {*result.f2p_failed, *result.p2p_failed}


def _log_text(result: GradeResult) -> str:
    if not result.log_path:
        return ""
    try:
        with open(result.log_path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _failure_kind(logs: list[str], tests: set[str]) -> Reason:
    """Why gold fails the same tests in every run (``logs``: the failing runs' test logs): the network, the CPU
    count, a missing C library, a missing dependency, or the environment's drift."""
    if any(NETWORK_MARKERS.search(log) for log in logs):
        return "network"
    if (tests and all(CPU_TESTS.search(t) for t in tests)) or any(CPU_LOG.search(log) for log in logs):
        return "cpu_count"
    if any(MISSING_LIBRARY.search(log) for log in logs):
        return "missing_library"
    if any(MISSING_MODULE.search(log) for log in logs):
        return "missing_dependency"
    return "env_drift"


def _deprecation_detail(logs: list[str]) -> str:
    """What the failures raise, when it is a deprecation warning turned into an error ("" otherwise): which
    warnings, most frequent first (a package newer than the code under test, under a filter that errors on them)."""
    found = Counter(f"{m.group(1)}: {m.group(2).strip()[:160]}"
                    for log in logs for m in DEPRECATION_ERROR.finditer(log))
    if not found:
        return ""
    top = [f"{text} (x{n})" for text, n in found.most_common(3)]
    return "; the log has deprecation warnings raised as errors: " + "; ".join(top)


def _other_python_detail(build: InstanceOutcome | None) -> str:
    """"; the image runs another Python than the spec's: <the build's warning>", or "" when it runs the spec's."""
    python = [w for w in (build.warnings if build else []) if w.startswith(("spec python", SUBSTITUTED_PYTHON))]
    return f"; the image runs another Python than the spec's: {python[0][:300]}" if python else ""


def _missing_library_detail(logs: list[str], build: InstanceOutcome | None) -> str:
    names = sorted({next(g for g in m.groups() if g) for log in logs for m in MISSING_LIBRARY.finditer(log)})
    detail = f"; a C library is missing: {', '.join(names[:5])} (a system library the official environment has)"
    skipped = [w for w in (build.warnings if build else []) if "allow-network" in w or "apt steps skipped" in w]
    if skipped:
        detail += f"; the build skipped its apt steps ({skipped[0][:200]}): build again with --allow-network"
    return detail


def _missing_dependency_detail(task: Task, modules: list[str]) -> str:
    tops = sorted({m.split(".")[0] for m in modules})
    needed = [top for top in tops for patch, name in ((task.patch, "gold"), (task.test_patch, "test"))
              if re.search(rf"^\+\s*(?:import|from)\s+{re.escape(top)}\b", patch, re.MULTILINE)]
    detail = f"; modules the tests could not import: {', '.join(modules[:10])}"
    if needed:
        detail += (f"; the gold or test patch imports {', '.join(sorted(set(needed)))}: a dependency the fix adds, "
                   "which the official image (built at the environment setup commit) has")
    return detail


def classify(task: Task, build: InstanceOutcome | None, gold: list[GradeResult], empty: GradeResult | None, *,
             image: str = "") -> InstanceValidation:
    """The verdict on one task from its build outcome (None: a prebuilt image), its gold gradings and its empty
    grading (the module docstring lists the reasons, in the order they are tried)."""
    v = InstanceValidation(instance_id=task.instance_id, repo=task.repo, version=task.version, valid=False,
                           image=image or (build.image if build else ""),
                           build=build.status if build else "prebuilt", build_s=build.seconds if build else 0.0,
                           gold=[g.status for g in gold], empty=empty.status if empty else "",
                           grade_s=round(sum(r.duration_s for r in [*gold, *([empty] if empty else [])]), 1),
                           logs=[r.log_path for r in [*gold, *([empty] if empty else [])] if r.log_path])
    if build is not None and not build.ok:
        v.reason, v.step, v.detail = "build_failed", build.step, build.message[:2000]
        return v
    graded = [g for g in gold if not g.infra]
    if len(graded) < len(gold) or not gold or empty is None or empty.infra:
        lost = next((r for r in [*gold, *([empty] if empty else [])] if r.infra), None)
        v.reason = "infra"
        v.detail = f"{lost.reason}: {lost.detail}"[:2000] if lost else "not graded"
        return v
    resolved = [g for g in gold if g.resolved]
    failing = [g for g in gold if not g.resolved]
    if failing and not resolved:
        if any(g.reason == "eval_timeout" for g in failing):
            v.reason, v.detail = "timeout", next(g.detail for g in failing if g.reason == "eval_timeout")
            return v
        if any(g.reason == "patch_apply_failed" for g in failing):
            v.reason = "gold_patch_failed"
            v.detail = next(g.detail for g in failing if g.reason == "patch_apply_failed")[:2000]
            return v
        if all(g.status == "tampered" for g in failing):  # a false positive of the grader's defences (issue 56)
            first = failing[0]
            v.reason, v.detail = "gold_tampered", f"gold graded tampered ({first.reason}): {first.detail}"[:2000]
            return v
    if failing and resolved:
        v.reason, v.tests = "flaky", sorted(set().union(*(_failed_tests(g) for g in failing)))
        v.detail = f"gold resolved in {len(resolved)} of {len(gold)} runs"
        return v
    if failing:
        always = set.intersection(*(_failed_tests(g) for g in failing))
        changing = set().union(*(_failed_tests(g) for g in failing)) - always
        if changing:  # unresolved every run, but not always on the same tests
            v.reason, v.tests = "flaky", sorted(changing)
            v.detail = f"gold unresolved in every run; {len(always)} tests fail every time"
            return v
        logs = [_log_text(r) for r in failing]
        v.reason, v.tests = _failure_kind(logs, always), sorted(always)
        first = failing[0]
        v.detail = (f"{first.status}{f' ({first.reason})' if first.reason else ''}: {len(first.f2p_failed)} of "
                    f"{first.f2p_total} FAIL_TO_PASS and {len(first.p2p_failed)} of {first.p2p_total} PASS_TO_PASS "
                    "tests fail")
        python = _other_python_detail(build)
        if v.reason == "env_drift" and python:  # e.g. Django 1.11 on 3.11: collections.Iterator is gone
            v.reason = "other_python"
            v.detail += python
        if v.reason == "env_drift":  # e.g. astropy 3.1: pytest 7.4's nose deprecation raised by astropy's conftest
            v.detail += _deprecation_detail(logs)
        if v.reason == "missing_library":  # e.g. cfgrib's ecCodes without the build's apt steps
            v.detail += _missing_library_detail(logs, build)
        elif v.reason == "missing_dependency":  # e.g. cdms2 (conda-only), appdirs (pylint 2.10's gold adds it)
            modules = sorted({m for log in logs for m in MISSING_MODULE.findall(log)})
            v.detail += _missing_dependency_detail(task, modules)
        if v.reason == "cpu_count":
            v.detail += ("; they need more CPUs than the sandbox has (the official harness sets no CPU limit): "
                         "validate again with --set sandbox.grading_cpus=N (N cores for the gradings; 0 = no "
                         "limit, which tools that read cgroup v1's cpu.shares, as pylint does, count as one core)")
        return v
    if empty.resolved:
        v.reason, v.detail = "empty_resolves", "the empty patch resolves: the FAIL_TO_PASS tests pass without the fix"
        # e.g. Django 1.11's 7530 on 3.6 for the spec's 3.5: the recorded failure may need that Python
        v.detail += _other_python_detail(build)
        return v
    v.valid = True
    return v


def _summary(rows: Iterable[InstanceValidation]) -> RepoValidation:
    s = RepoValidation()
    seconds = 0.0
    for v in rows:
        s.instances += 1
        seconds += v.build_s + v.grade_s
        built = v.build in ("built", "cached", "prebuilt")
        s.built += built
        s.gold_resolved += built and bool(v.gold) and all(g == "resolved" for g in v.gold)
        s.empty_resolved += built and v.empty == "resolved"
        s.validated += v.valid
        if v.reason:
            s.reasons[v.reason] = s.reasons.get(v.reason, 0) + 1
    s.seconds_per_task = round(seconds / s.instances, 1) if s.instances else 0.0
    s.built_frac = round(s.built / s.instances, 4) if s.instances else 0.0
    s.gold_resolved_frac = round(s.gold_resolved / s.built, 4) if s.built else 0.0
    s.empty_resolved_frac = round(s.empty_resolved / s.built, 4) if s.built else 0.0
    return s


def build_validation_report(verdicts: list[InstanceValidation], *, tasks: str, runs: int,
                            elapsed_s: float) -> ValidationReport:
    verdicts = sorted(verdicts, key=lambda v: v.instance_id)
    overall = _summary(verdicts)
    repos = {repo: _summary(v for v in verdicts if v.repo == repo) for repo in sorted({v.repo for v in verdicts})}
    keys = sorted({environment_key(v) for v in verdicts})
    versions = {key: _summary(v for v in verdicts if environment_key(v) == key) for key in keys}
    return ValidationReport(tasks=tasks, eval_only=is_eval_set(tasks), runs=runs, total=len(verdicts),
                            validated=overall.validated,
                            reasons=dict(sorted(overall.reasons.items())), overall=overall, repos=repos,
                            versions=versions, elapsed_s=round(elapsed_s, 1), instances=verdicts)


def format_validation(report: ValidationReport, *, versions: bool = False) -> str:
    """The per-repository table (``versions``: per environment, then per repository), with the overall row."""
    rows = [*(report.versions.items() if versions else ()), *report.repos.items(), ("all", report.overall)]
    width = max(28, *(len(name) + 1 for name, _ in rows))
    lines = [f"{'repository' + (' version' if versions else ''):<{width}} {'tasks':>5} {'built':>6} {'gold':>6} "
             f"{'empty':>6} {'valid':>5} {'s/task':>7}  reasons"]
    for name, s in rows:
        reasons = ", ".join(f"{k} {n}" for k, n in sorted(s.reasons.items()))
        lines.append(f"{name:<{width}} {s.instances:>5} {s.built_frac:>6.0%} {s.gold_resolved_frac:>6.0%} "
                     f"{s.empty_resolved_frac:>6.0%} {s.validated:>5} {s.seconds_per_task:>7.0f}  {reasons}")
    return "\n".join(lines)


def _records(path: Path, kind: type[RecordT]) -> list[RecordT]:
    """The JSON lines of ``path`` decoded as ``kind``, in order ([] without the file; a torn line is skipped: the
    last one of a run cut off)."""
    if not path.exists():
        return []
    out: list[RecordT] = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(msgspec.json.decode(line, type=kind))
        except msgspec.DecodeError:
            continue
    return out


def load_grades(path: Path) -> dict[tuple[str, GradeKind, int], GradeRecord]:
    """The gradings an earlier run of the same ``--out`` finished (a torn last line is ignored)."""
    return {(rec.instance_id, rec.kind, rec.run): rec for rec in _records(path, GradeRecord)}


def load_verdicts(path: Path) -> dict[str, InstanceValidation]:
    """The verdicts an earlier run of the same ``--out`` made (verdicts.jsonl; the last of a task's wins; a torn
    last line is ignored)."""
    return {v.instance_id: v for v in _records(path, InstanceValidation)}


BuildFn = Callable[[Task], InstanceOutcome | None]
PruneFn = Callable[[InstanceOutcome, bool], None]  # (the outcome, whether its environment is done)


async def validate_tasks(
    config: ClusterConfig, tasks: list[Task], out: Path, *, build: BuildFn, runs: int = 3, concurrency: int = 2,
    jobs: int = 1, timeout_s: float = 1800.0, resolver: ImageResolver | None = None, tasks_source: str = "",
    progress: bool = True, prune: PruneFn | None = None,
) -> ValidationReport:
    """Build (``build``: a task's image outcome, or None when the task runs a prebuilt image; called in worker
    threads, ``jobs`` at once) and grade every task; gradings start as soon as a task's image is ready.
    ``prune``: called (in a worker thread) with each outcome whose image this ``out`` built (now, or in an earlier
    run cut off before its verdict: ``built.txt``) once its task's verdict is made, and whether it was the last
    task of its environment still to judge; with it, at most
    ``jobs + 1`` tasks are built and not yet judged, and the verdicts an earlier run of ``out`` made are kept."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    started = time.monotonic()
    grades_path = out / "grades.jsonl"
    previous = load_grades(grades_path)
    mapping = dict(resolver.mapping) if resolver else {}
    base = resolver or ImageResolver()
    builds: dict[str, InstanceOutcome | None] = {}
    results: dict[tuple[str, GradeKind, int], GradeResult] = {}
    image_ids: dict[str, str] = {}
    bar = Progress(len(tasks), "validate") if progress and tasks else None
    verdicts: dict[str, InstanceValidation] = {}  # by instance id, as each task finishes
    if prune is not None:  # their images were pruned: the verdicts made stand (RETRIED_ON_RESUME: made again)
        wanted = {t.instance_id for t in tasks}
        verdicts = {i: v for i, v in load_verdicts(out / "verdicts.jsonl").items() if i in wanted and
                    v.reason not in RETRIED_ON_RESUME}
        for v in verdicts.values():
            if bar:
                bar.advance("validated" if v.valid else v.reason or "?")
    todo = [t for t in tasks if t.instance_id not in verdicts]
    to_judge = Counter(environment_key(t) for t in todo)  # per environment, the tasks without a verdict yet
    built_path = out / "built.txt"  # the images this --out built (pruned only those)
    built_here = set(built_path.read_text().split()) if built_path.exists() else set()
    build_limit = anyio.CapacityLimiter(jobs)
    # with prune, the images built and not yet judged (each holds disk until its verdict prunes it)
    waiting = anyio.Semaphore(jobs + 1) if prune is not None else None
    send, receive = anyio.create_memory_object_stream[Task](max(1, len(todo)))

    with grades_path.open("ab") as grades_file, (out / "verdicts.jsonl").open("ab") as verdicts_file:
        async with running_pool(config) as pool:
            # the resolver holds ``mapping`` itself (not a copy): each image built below is graded under its name
            grader = Grader(GraderConfig(timeout_s=timeout_s, concurrency=concurrency), pool, log_dir=out / "logs",
                            resolver=ImageResolver(template=base.template, mapping=mapping))

            async def build_one(task: Task) -> None:
                outcome = await anyio.to_thread.run_sync(build, task, limiter=build_limit, abandon_on_cancel=True)
                builds[task.instance_id] = outcome
                if outcome is not None and outcome.status == "built" and outcome.image not in built_here:
                    built_here.add(outcome.image)
                    with built_path.open("a") as f:
                        f.write(outcome.image + "\n")
                if outcome is not None and outcome.ok and outcome.image:
                    mapping[task.instance_id] = outcome.image
                image = mapping.get(task.instance_id) or base.resolve(task)
                image_ids[task.instance_id] = await anyio.to_thread.run_sync(image_id, image) or ""
                await send.send(task)

            async def grade(task: Task, kind: GradeKind, run: int) -> None:
                key = (task.instance_id, kind, run)
                earlier = previous.get(key)
                if earlier is not None and earlier.image_id == image_ids.get(task.instance_id, ""):
                    results[key] = earlier.result  # graded by an earlier run on this very image
                    return
                patch = task.patch if kind == "gold" else ""
                result = await grader.grade(task, patch, label=kind if kind == "empty" else f"gold{run}")
                results[key] = result
                record = GradeRecord(instance_id=task.instance_id, kind=kind, run=run,
                                     image=mapping.get(task.instance_id, ""), result=result,
                                     image_id=image_ids.get(task.instance_id, ""))
                grades_file.write(msgspec.json.encode(record) + b"\n")
                grades_file.flush()

            async def grade_all(task: Task) -> None:
                outcome = builds.get(task.instance_id)
                if outcome is None or outcome.ok:
                    async with anyio.create_task_group() as each:
                        for run in range(runs):
                            each.start_soon(grade, task, "gold", run)
                        each.start_soon(grade, task, "empty", 0)
                # a task's gradings are all in: its verdict is final, made once
                v = verdicts[task.instance_id] = _verdict(task, outcome, results, runs,
                                                          mapping.get(task.instance_id) or base.resolve(task))
                verdicts_file.write(msgspec.json.encode(v) + b"\n")
                verdicts_file.flush()
                to_judge[environment_key(task)] -= 1
                if prune is not None and waiting is not None:
                    try:
                        if outcome is not None and outcome.ok and outcome.image in built_here:  # never one that was
                            await anyio.to_thread.run_sync(prune, outcome, to_judge[environment_key(task)] == 0)
                    finally:  # the next build goes on even if pruning failed
                        waiting.release()
                # the verdicts so far, for a look (or a cross-check) while a long run goes on
                write_validation(build_validation_report(list(verdicts.values()), tasks=tasks_source, runs=runs,
                                                         elapsed_s=time.monotonic() - started), out)
                if bar:
                    bar.advance("validated" if v.valid else v.reason or "?")

            async def builder() -> None:
                async with send, anyio.create_task_group() as building:
                    for task in todo:
                        if waiting is not None:
                            await waiting.acquire()
                        building.start_soon(build_one, task, name=f"build {task.instance_id}")

            async def grading() -> None:
                async with receive, anyio.create_task_group() as gradings:
                    async for task in receive:
                        gradings.start_soon(grade_all, task, name=f"validate {task.instance_id}")

            async with anyio.create_task_group() as work:
                work.start_soon(builder, name="builder")
                work.start_soon(grading, name="grading")
    return build_validation_report([verdicts[t.instance_id] for t in tasks], tasks=tasks_source, runs=runs,
                                   elapsed_s=time.monotonic() - started)


def _verdict(task: Task, outcome: InstanceOutcome | None, results: dict[tuple[str, GradeKind, int], GradeResult],
             runs: int, image: str) -> InstanceValidation:
    gold = [results[k] for r in range(runs) if (k := (task.instance_id, "gold", r)) in results]
    empty = results.get((task.instance_id, "empty", 0))
    return classify(task, outcome, gold, empty, image=image)


def write_validation(report: ValidationReport, out: Path) -> list[Path]:
    """validation.json, validated.txt and image-map.json in ``out``."""
    import json

    images = {v.instance_id: v.image for v in report.instances if v.image and v.build != "failed"}
    texts = {
        "validation.json": msgspec.json.format(msgspec.json.encode(report)),
        "validated.txt": "".join(f"{v.instance_id}\n" for v in report.instances if v.valid).encode(),
        "image-map.json": (json.dumps(images, indent=2, sort_keys=True) + "\n").encode(),
    }
    for name, data in texts.items():  # whole files only: a reader (grade_real) may look while a run goes on
        partial = out / f".{name}.part"
        partial.write_bytes(data)
        partial.replace(out / name)
    return [out / name for name in texts]
