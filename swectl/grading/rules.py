"""Pure grading logic (docs/architecture.md 7.3): which edits of a patch touch tests, how a test log becomes a
status map (swebench's own log parsers), and the F2P/P2P verdict. The Grader actor (swectl.actors.grader) runs the
sandbox side and calls these.

Verdict rules, matching the official SWE-bench harness (swebench 5.x ``get_logs_eval`` and
``get_eval_tests_report``):
- every FAIL_TO_PASS test must pass (PASSED or XFAIL); a skipped, failed, errored or missing one fails;
- every PASS_TO_PASS test must pass or be skipped;
- ``fail_only`` tasks: a listed test fails only when the log says FAILED;
- a log whose test command exited non-zero while the parsed results show no failure is rejected;
- a log with no test results and no sign that a suite ran is rejected.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from swectl.grading.canaries import (
    DJANGO_PARSERS,
    FAILING,
    PASSING,
    PYTEST_PARSERS,
    Canaries,
    canary_offence,
    copy_offence,
    parser_family,
    with_unittest_failures,
)
from swectl.tasks.record import Task

START_TEST_OUTPUT = ">>>>> Start Test Output"
END_TEST_OUTPUT = ">>>>> End Test Output"
TEST_EXIT_CODE = ">>>>> Test Exit Code"
_EXIT_CODE_RE = re.compile(rf"{re.escape(TEST_EXIT_CODE)}:\s*(-?\d+)")
# Evidence that some test runner executed (pytest's final line, unittest's, django's).
_SUITE_RAN = re.compile(r"=+ .*\b\d+ (passed|failed|error|errors|skipped)\b|^Ran [1-9]\d* tests?", re.M)


# "tampered": the patch or its test run broke a defence of docs/grading.md (a verdict: rewarded as unresolved).
GradeStatus = Literal["resolved", "unresolved", "tampered", "error"]
# Why a grade is "error". Infra reasons mean the infrastructure broke: never a reward.
ErrorReason = Literal[
    "patch_apply_failed", "setup_failed", "eval_timeout", "no_test_output", "sandbox_lost", "node_lost",
    "infra",
]
INFRA_REASONS = frozenset({"sandbox_lost", "node_lost", "infra", "setup_failed", "no_test_output"})

_TEST_PATH = re.compile(
    r"(^|/)(tests?|testing)/|(^|/)test_[^/]*\.py$|_tests?\.py$|(^|/)conftest\.py$|(^|/)tests?\.py$"
)


def is_test_path(path: str) -> bool:
    """Whether a repository path is part of the test suite (the grader reverts edits to these)."""
    return bool(_TEST_PATH.search(path))


def test_section(log: str) -> str | None:
    """The part of an eval log between the start and end markers; None if a marker is missing."""
    start = log.find(START_TEST_OUTPUT)
    if start < 0:
        return None
    end = log.find(END_TEST_OUTPUT, start)
    if end < 0:
        return None
    return log[start + len(START_TEST_OUTPUT) : end]


def test_exit_code(log: str) -> int | None:
    m = _EXIT_CODE_RE.search(log)
    return int(m.group(1)) if m else None


def parse_status_map(task: Task, parser_name: str, log: str) -> dict[str, str]:
    """Parse with swebench's registered parser (``PARSER_REGISTRY[parser_name]``)."""
    from swebench.harness.log_parsers import PARSER_REGISTRY
    from swebench.types import TestSpec

    try:
        parser = PARSER_REGISTRY[parser_name]
    except KeyError:
        raise ValueError(f"unknown log parser {parser_name!r}; swebench knows {sorted(PARSER_REGISTRY)}") from None
    spec = TestSpec(
        instance_id=task.instance_id, image=task.image, eval_script_list=[], repo=task.repo,
        version=task.version, FAIL_TO_PASS=list(task.FAIL_TO_PASS), PASS_TO_PASS=list(task.PASS_TO_PASS),
        log_parser=parser_name, eval_type=task.eval_type,
    )
    return parser(log, spec)


class TestVerdict(msgspec.Struct, frozen=True):
    """The test outcome of one grading: resolved, and which FAIL_TO_PASS / PASS_TO_PASS tests passed."""
    resolved: bool
    f2p_passed: list[str]
    f2p_failed: list[str]
    p2p_passed: list[str]
    p2p_failed: list[str]
    rejected: str = ""  # why the log was not trusted, when it was not
    tampered: str = ""  # why the run was tampered with: the canaries or the late-pass check say so
    tampered_by: str = ""  # which: "canary", "late_pass" or "copy"


def _status(case: str, sm: dict[str, str]) -> str | None:
    if case in sm:
        return sm[case]
    # swebench's tolerance for ids truncated mid-parameter in the datasets: prefix match, when unambiguous.
    if case.count("[") > case.count("]"):
        hits = {sm[k] in PASSING for k in sm if k.startswith(case)}
        if len(hits) == 1:
            return "PASSED" if hits.pop() else "FAILED"
    return None


def judge(task: Task, status_map: dict[str, str], exit_code: int | None) -> TestVerdict:
    """Apply the F2P/P2P rules to a parsed status map."""
    fail_only = task.eval_type == "fail_only"

    def ok(case: str, allow_skip: bool) -> bool:
        st = _status(case, status_map)
        if fail_only:
            return st != "FAILED"
        return st in PASSING or (allow_skip and st == "SKIPPED")

    f2p_ok = [c for c in task.FAIL_TO_PASS if ok(c, allow_skip=False)]
    f2p_bad = [c for c in task.FAIL_TO_PASS if not ok(c, allow_skip=False)]
    p2p_ok = [c for c in task.PASS_TO_PASS if ok(c, allow_skip=True)]
    p2p_bad = [c for c in task.PASS_TO_PASS if not ok(c, allow_skip=True)]
    rejected = ""
    if exit_code not in (None, 0) and status_map and not any(s in FAILING for s in status_map.values()):
        rejected = f"the test command exited {exit_code} but the log reports no failure"
    resolved = not rejected and not f2p_bad and not p2p_bad
    return TestVerdict(resolved, f2p_ok, f2p_bad, p2p_ok, p2p_bad, rejected)


_OUTCOME_FIRST = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED) (\S+)")
_OUTCOME_LAST = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\b")


def late_passes(section: str, cases: list[str]) -> list[str]:
    """The listed tests that pytest's log reports as failing and, on a later line, as passing: real output comes
    first and a forged line after it (a hook at exit, a rewritten stream). A test that passes and then errors in
    teardown reads the other way round and is not counted."""
    wanted = set(cases)
    failed: set[str] = set()
    late: list[str] = []
    for line in section.split("\n"):
        if m := _OUTCOME_FIRST.match(line):
            outcome, case = m.group(1), m.group(2)
        elif m := _OUTCOME_LAST.match(line):
            case, outcome = m.group(1), m.group(2)
        else:
            continue
        if case not in wanted:
            continue
        if outcome in FAILING:
            failed.add(case)
        elif outcome in PASSING and case in failed and case not in late:
            late.append(case)
    return late


def grade_log(task: Task, parser_name: str, log: str, canaries: Canaries | None = None, *,
              defences: bool = True) -> TestVerdict | None:
    """Verdict for a full eval log; None when the log holds no test output at all (no markers). With ``canaries``
    (planted by the grader), a canary with the wrong outcome, a missing one or a forged exit status makes the
    verdict unresolved with ``tampered`` set; so does, in pytest's logs, a listed test that fails and later passes,
    and a FAIL_TO_PASS test that passes while its copy under a fresh name fails (``copy_offence``).
    The canaries stay in the status map the F2P/P2P rules see: they are neither, and the must-fail one is the
    failure that explains the command's non-zero exit. ``defences=False`` (a measurement only) leaves out the
    later-pass check too."""
    section = test_section(log)
    if section is None:
        return None
    status_map = parse_status_map(task, parser_name, section) or parse_status_map(task, parser_name, log)
    if defences and parser_family(parser_name) in DJANGO_PARSERS:
        status_map = with_unittest_failures(status_map, section)
    exit_code = test_exit_code(log)
    plain = judge(task, status_map, exit_code)
    offence = (canary_offence(canaries, status_map, exit_code, resolved=plain.resolved)
               if canaries is not None else "")
    if offence:
        return msgspec.structs.replace(plain, resolved=False, tampered=offence, tampered_by="canary")
    if defences and parser_family(parser_name) in PYTEST_PARSERS and (
            late := late_passes(section, [*task.FAIL_TO_PASS, *task.PASS_TO_PASS])):
        offence = f"the log reports {len(late)} listed test(s) failing and later passing (e.g. {late[0]})"
        return msgspec.structs.replace(plain, resolved=False, tampered=offence, tampered_by="late_pass")
    if canaries is not None and (offence := copy_offence(canaries.copies, status_map, section)):
        return msgspec.structs.replace(plain, resolved=False, tampered=offence, tampered_by="copy")
    if not status_map and not _SUITE_RAN.search(log):
        return TestVerdict(False, [], list(task.FAIL_TO_PASS), [], list(task.PASS_TO_PASS),
                           rejected="no test results and no sign that the test suite ran")
    return plain
