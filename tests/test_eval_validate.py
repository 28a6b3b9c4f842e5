"""The verdicts of `swectl tasks validate` (swectl/eval/validate.py) from gradings, and where a failed build
stopped (swectl/images/instance.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from swectl.actors.grader import GradeResult
from swectl.eval.validate import (
    GradeRecord,
    build_validation_report,
    classify,
    format_validation,
    load_grades,
    load_verdicts,
    pick_per_version,
)
from swectl.images.builds import failed_run_step
from swectl.images.instance import InstanceOutcome
from swectl.tasks.record import Task

TASK = Task(instance_id="o__r-1", repo="o/r", version="1.0", base_commit="abc", patch="p", test_patch="t",
            problem_statement="x", FAIL_TO_PASS=["t::a"], PASS_TO_PASS=["t::b"])


def grade(status: str = "resolved", *, reason: str = "", failed: tuple[str, ...] = (), infra: bool = False,
          log: str = "", tmp: Path | None = None) -> GradeResult:
    path = ""
    if log and tmp is not None:
        file = tmp / f"log{len(list(tmp.iterdir()))}.txt"
        file.write_text(log)
        path = str(file)
    return GradeResult(instance_id=TASK.instance_id, status=status, reason=reason, f2p_failed=list(failed),
                       infra=infra, log_path=path, f2p_total=1, p2p_total=1)


def test_valid_when_gold_always_resolves_and_empty_does_not() -> None:
    v = classify(TASK, None, [grade(), grade(), grade()], grade("unresolved", failed=("t::a",)))
    assert v.valid and v.reason is None and v.build == "prebuilt"


def test_build_failure_names_the_step() -> None:
    build = InstanceOutcome(instance_id=TASK.instance_id, status="failed", message="boom", step="install_deps")
    v = classify(TASK, build, [], None)
    assert (v.valid, v.reason, v.step, v.detail) == (False, "build_failed", "install_deps", "boom")


def test_flaky_names_the_tests_that_changed() -> None:
    v = classify(TASK, None, [grade(), grade("unresolved", failed=("t::b",)), grade()], grade("unresolved"))
    assert (v.reason, v.tests) == ("flaky", ["t::b"])
    v = classify(TASK, None, [grade("unresolved", failed=("t::a", "t::c")), grade("unresolved", failed=("t::a",))],
                 grade("unresolved"))
    assert (v.reason, v.tests) == ("flaky", ["t::c"])


def test_same_failures_every_run_are_drift_network_or_cpu(tmp_path: Path) -> None:
    drift = [grade("unresolved", failed=("t::a",), log="AssertionError: ids differ", tmp=tmp_path) for _ in range(2)]
    v = classify(TASK, None, drift, grade("unresolved"))
    assert (v.reason, v.tests) == ("env_drift", ["t::a"])
    assert "could not import" not in v.detail
    conda_only = [grade("unresolved", failed=("t::cdms2",), tmp=tmp_path,
                        log="SKIPPED [1] t.py:3783: could not import 'cdms2': No module named 'cdms2'")] * 2
    v = classify(TASK, None, conda_only, grade("unresolved"))
    assert v.reason == "missing_dependency", v
    assert v.detail.endswith("modules the tests could not import: cdms2"), v.detail
    net = [grade("unresolved", failed=("t::a",), tmp=tmp_path,
                 log="requests.exceptions.ConnectionError: Failed to establish a new connection") for _ in range(2)]
    assert classify(TASK, None, net, grade("unresolved")).reason == "network"
    cpu = [grade("unresolved", failed=("tests/test_self.py::test_parallel_execution",), log="x", tmp=tmp_path)]
    assert classify(TASK, None, cpu, grade("unresolved")).reason == "cpu_count"
    skipped = [grade("unresolved", failed=("tests/lint/unittest_lint.py::test_custom_should_analyze_file",),
                     log="SKIPPED [1] tests/lint/unittest_lint.py:774: Need 2 or more cores for test to be meaningful",
                     tmp=tmp_path) for _ in range(2)]  # pylint 6528 in a one-CPU sandbox: skipped, so not passed
    v = classify(TASK, None, skipped, grade("unresolved"))
    assert v.reason == "cpu_count" and "--set sandbox.grading_cpus=N" in v.detail


def test_timeout_patch_failure_infra_and_empty_resolving() -> None:
    assert classify(TASK, None, [grade("error", reason="eval_timeout")] * 2, grade("unresolved")).reason == "timeout"
    assert classify(TASK, None, [grade("error", reason="patch_apply_failed")], grade("unresolved")).reason == \
        "gold_patch_failed"
    # gold called tampered by the grader's defences: their false positive, named as such (not env_drift)
    tampered = classify(TASK, None, [grade("tampered", reason="copy")], grade("unresolved"))
    assert tampered.reason == "gold_tampered" and tampered.detail.startswith("gold graded tampered (copy)")
    lost = grade("error", reason="sandbox_lost", infra=True)
    assert classify(TASK, None, [grade(), lost], grade("unresolved")).reason == "infra"
    assert classify(TASK, None, [grade()], lost).reason == "infra"
    assert classify(TASK, None, [grade()], None).reason == "infra"  # never graded: not the task's fault
    assert classify(TASK, None, [grade()], grade()).reason == "empty_resolves"


def test_report_fractions_are_per_repository_and_of_the_built() -> None:
    failed = InstanceOutcome(instance_id="o__r-2", status="failed", step="setup")
    rows = [
        classify(TASK, None, [grade()], grade("unresolved")),
        classify(msgspec.structs.replace(TASK, instance_id="o__r-2"), failed, [], None),
        classify(msgspec.structs.replace(TASK, instance_id="x__y-1", repo="x/y"), None, [grade()], grade()),
    ]
    report = build_validation_report(rows, tasks="/data/swe_bench_verified.jsonl", runs=1, elapsed_s=1.0)
    assert report.eval_only is True
    assert report.validated == 1 and report.reasons == {"build_failed": 1, "empty_resolves": 1}
    r = report.repos["o/r"]
    assert (r.instances, r.built, r.built_frac, r.gold_resolved_frac, r.empty_resolved_frac) == (2, 1, 0.5, 1.0, 0.0)
    assert report.repos["x/y"].empty_resolved_frac == 1.0


def test_load_grades_skips_a_torn_last_line(tmp_path: Path) -> None:
    rec = GradeRecord(instance_id="a", kind="gold", run=1, image="img", result=grade())
    path = tmp_path / "grades.jsonl"
    path.write_bytes(msgspec.json.encode(rec) + b"\n" + msgspec.json.encode(rec)[:20])
    assert list(load_grades(path)) == [("a", "gold", 1)]
    assert load_grades(tmp_path / "missing.jsonl") == {}


def test_failed_run_step_reads_podman_builds_last_step() -> None:
    out = "STEP 1/9: FROM base\nSTEP 4/9: RUN bash /opt/swectl/install-deps.sh && mkdir\nerror: exit 1\n"
    assert failed_run_step(out) == "install_deps"
    assert failed_run_step(out + "STEP 8/9: RUN bash /opt/swectl/setup.sh\nexit 2\n") == "setup"
    assert failed_run_step("Error: no such image") == "podman_build"


def test_a_missing_c_library_or_dependency_is_named_not_drift(tmp_path: Path) -> None:
    """xarray 0.12 without the build's apt steps: cfgrib's RuntimeError for ecCodes fails every test module's
    collection; pylint 2.10: the gold patch imports appdirs, which the environment lacks."""
    eccodes = [grade("unresolved", failed=("t::a",), tmp=tmp_path, log=(
        "ERROR xarray/tests/test_backends.py - RuntimeError: ecCodes library not found using ['eccodes', "
        "'libeccodes.so', 'libeccodes']"))] * 2
    skipped = InstanceOutcome(instance_id=TASK.instance_id, status="cached", warnings=[
        "the compiler and C libraries the project needs come from apt (libeccodes-dev): not installed without "
        "--allow-network"])
    v = classify(TASK, skipped, eccodes, grade("unresolved"))
    assert v.reason == "missing_library" and "ecCodes" in v.detail and "--allow-network" in v.detail, v.detail
    shared = [grade("unresolved", failed=("t::a",), tmp=tmp_path,
                    log="ImportError: libGL.so.1: cannot open shared object file: No such file or directory")] * 2
    v = classify(TASK, None, shared, grade("unresolved"))
    assert v.reason == "missing_library" and "libGL.so.1" in v.detail and "allow-network" not in v.detail
    task = msgspec.structs.replace(TASK, patch="diff --git a/p.py b/p.py\n--- a/p.py\n+++ b/p.py\n@@ -1 +1,2 @@\n"
                                   " x\n+import appdirs\n")
    appdirs = [grade("unresolved", failed=("t::a",), tmp=tmp_path,
                     log="E   ModuleNotFoundError: No module named 'appdirs'")] * 2
    v = classify(task, None, appdirs, grade("unresolved"))
    assert v.reason == "missing_dependency" and "the gold or test patch imports appdirs" in v.detail, v.detail
    v = classify(TASK, None, appdirs, grade("unresolved"))
    assert v.reason == "missing_dependency" and "patch imports" not in v.detail


def test_the_patches_that_declare_dependencies_are_found() -> None:
    from swectl.images.instance import dependency_patches

    cfg = "diff --git a/setup.cfg b/setup.cfg\n--- a/setup.cfg\n+++ b/setup.cfg\n@@ -1 +1,2 @@\n x\n+    appdirs\n"
    code = "diff --git a/src/a.py b/src/a.py\n--- a/src/a.py\n+++ b/src/a.py\n@@ -1 +1 @@\n-x\n+y\n"
    reqs = cfg.replace("setup.cfg", "requirements_test.txt")
    assert dependency_patches(msgspec.structs.replace(TASK, patch=cfg + code, test_patch=code)) == [cfg + code]
    assert dependency_patches(msgspec.structs.replace(TASK, patch=code, test_patch=reqs)) == [reqs]
    assert dependency_patches(msgspec.structs.replace(TASK, patch=code, test_patch=code)) == []


def test_per_version_picks_spread_over_each_environment_and_group_it() -> None:
    rows = [msgspec.structs.replace(TASK, instance_id=f"o__r-{i}", version="1.0" if i < 6 else "2.0")
            for i in (5, 1, 4, 2, 3, 0, 7, 6)]
    rows.append(msgspec.structs.replace(TASK, instance_id="a__b-1", repo="a/b", version="0.1"))
    picked = pick_per_version(rows, 2)
    # a/b 0.1 has one row; o/r 1.0 has six (ids 0..5: picks 0 and 3); o/r 2.0 has two
    assert [t.instance_id for t in picked] == ["a__b-1", "o__r-0", "o__r-3", "o__r-6", "o__r-7"]
    assert pick_per_version(list(reversed(rows)), 2) == picked  # the file's order does not matter
    assert [t.instance_id for t in pick_per_version(rows, 1)] == ["a__b-1", "o__r-0", "o__r-6"]


def test_report_has_a_row_per_environment_with_its_time_per_task(tmp_path: Path) -> None:
    built = InstanceOutcome(instance_id=TASK.instance_id, status="built", seconds=30.0)
    slow = msgspec.structs.replace(grade(), duration_s=20.0)
    other = msgspec.structs.replace(TASK, instance_id="o__r-9", version="2.0")
    rows = [classify(TASK, built, [slow, slow], msgspec.structs.replace(grade("unresolved"), duration_s=10.0)),
            classify(other, None, [grade("unresolved", failed=("t::a",))], grade("unresolved"))]
    assert rows[0].grade_s == 50.0
    report = build_validation_report(rows, tasks="t.jsonl", runs=2, elapsed_s=1.0)
    assert sorted(report.versions) == ["o/r 1.0", "o/r 2.0"]
    assert report.versions["o/r 1.0"].validated == 1 and report.versions["o/r 1.0"].seconds_per_task == 80.0
    assert report.versions["o/r 2.0"].reasons == {"env_drift": 1}
    assert report.repos["o/r"].seconds_per_task == 40.0
    table = format_validation(report, versions=True).splitlines()
    assert [line.split()[:3] for line in table[1:3]] == [["o/r", "1.0", "1"], ["o/r", "2.0", "1"]]
    assert "env_drift 1" in table[2]
    assert len(format_validation(report).splitlines()) == 3  # the header, o/r and all

    path = tmp_path / "verdicts.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(v) + b"\n" for v in rows) + b'{"instance_id": "torn')
    assert load_verdicts(path) == {v.instance_id: v for v in rows}


def test_gold_failing_on_another_python_than_the_specs_is_named_so(tmp_path: Path) -> None:
    """Django 1.11 on the base image's 3.11 (its spec's 3.5 is not on the node): every test fails to import
    (collections.Iterator), which is not drift of the environment's packages."""
    warning = "spec python 3.5 is not available offline on this node (...): the venv runs python 3.11"
    built = InstanceOutcome(instance_id=TASK.instance_id, status="built", warnings=[warning])
    log = "ImportError: cannot import name 'Iterator' from 'collections'\n"
    v = classify(TASK, built, [grade("unresolved", failed=("t::a",), log=log, tmp=tmp_path)], grade("unresolved"))
    assert v.reason == "other_python" and warning in v.detail
    plain = classify(TASK, None, [grade("unresolved", failed=("t::a",), log=log, tmp=tmp_path)], grade("unresolved"))
    assert plain.reason == "env_drift"


def test_an_empty_patch_resolving_on_another_python_than_the_specs_says_so() -> None:
    """Django 1.11's 7530 on 3.6 (the spec's 3.5 is not on the node): the empty patch resolves; the row is not
    valid, and the detail says the failure the dataset recorded was under another Python."""
    warning = "python substituted: spec python 3.5 is not available offline on this node: the venv runs python 3.6.15"
    built = InstanceOutcome(instance_id=TASK.instance_id, status="built", warnings=[warning])
    v = classify(TASK, built, [grade()], grade())
    assert v.reason == "empty_resolves" and not v.valid and warning in v.detail
    assert "another Python" not in classify(TASK, None, [grade()], grade()).detail


def test_drift_from_deprecations_raised_as_errors_names_them(tmp_path: Path) -> None:
    """astropy 3.1: its conftest makes every DeprecationWarning an error, and pytest 7.4 warns on nose-style setup:
    still env_drift (nothing is missing), with the warnings named, most frequent first."""
    nose = ("E               pytest.PytestRemovedIn8Warning: Support for nose tests is deprecated and will be "
            "removed in a future release.\n")
    log = nose * 3 + "E   DeprecationWarning: distutils Version classes are deprecated.\n"
    v = classify(TASK, None, [grade("unresolved", failed=("t::a",), log=log, tmp=tmp_path)], grade("unresolved"))
    assert v.reason == "env_drift"
    assert v.detail.endswith("raised as errors: PytestRemovedIn8Warning: Support for nose tests is deprecated and "
                             "will be removed in a future release. (x3); DeprecationWarning: distutils Version classes "
                             "are deprecated. (x1)")
    plain = classify(TASK, None, [grade("unresolved", failed=("t::a",), log="E  assert 1 == 2\n", tmp=tmp_path)],
                     grade("unresolved"))
    assert plain.reason == "env_drift" and "deprecation" not in plain.detail
