"""benchmarks/verified_coverage.py's merge with a results file of an earlier machine (``--previous``): its rows stay,
the new folders' verdicts add to their environments' counts, and a row that the earlier file holds only as a
summary cannot be validated again silently."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from benchmarks.verified_coverage import main, merged_summary
from swectl.eval.validate import InstanceValidation, RepoValidation, ValidationReport


def verdict(instance_id: str, valid: bool = True) -> InstanceValidation:
    return InstanceValidation(instance_id=instance_id, repo="o/r", version="1.0", valid=valid,
                              reason=None if valid else "env_drift", build="built", build_s=10.0,
                              gold=["resolved" if valid else "unresolved"], empty="unresolved", grade_s=20.0)


def folder(tmp_path: Path, name: str, verdicts: list[InstanceValidation]) -> Path:
    out = tmp_path / name
    out.mkdir()
    report = ValidationReport(tasks="t", runs=1, total=len(verdicts), validated=0, reasons={},
                              overall=RepoValidation(), repos={}, versions={}, elapsed_s=0.0, instances=verdicts)
    (out / "validation.json").write_bytes(msgspec.json.encode(report))
    return out


def test_merged_summary_adds_counts_and_weights_the_time() -> None:
    a = RepoValidation(instances=2, built=2, gold_resolved=2, validated=2, seconds_per_task=10.0)
    b = RepoValidation(instances=1, built=1, gold_resolved=0, reasons={"env_drift": 1}, seconds_per_task=40.0)
    m = merged_summary(a, b)
    assert (m.instances, m.built, m.gold_resolved, m.validated, m.reasons) == (3, 3, 2, 2, {"env_drift": 1})
    assert m.seconds_per_task == 20.0 and m.gold_resolved_frac == round(2 / 3, 4)


def test_previous_coverage_keeps_its_rows_and_adds_the_new(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"repo": "o/r", "version": "1.0", "instance_id": f"o__r-{i}"}) + "\n"
                             for i in range(4)))
    results = tmp_path / "results.json"
    first = folder(tmp_path, "a", [verdict("o__r-0"), verdict("o__r-1", valid=False)])
    assert main(["--validation", str(first), "--tasks", str(tasks), "--results", str(results)]) == 0
    recorded = json.loads(results.read_text())
    del recorded["coverage"]["verdicts"]  # as files written before 2026-12-08 are: summaries only
    results.write_text(json.dumps(recorded))
    second = folder(tmp_path, "b", [verdict("o__r-2")])
    assert main(["--validation", str(second), "--tasks", str(tasks), "--results", str(results), "--previous"]) == 0
    coverage = json.loads(results.read_text())["coverage"]
    env = coverage["environments"]["o/r 1.0"]
    assert env["rows"] == {"o__r-0": "validated", "o__r-1": "env_drift", "o__r-2": "validated"}
    assert (env["validated"]["instances"], env["validated"]["validated"]) == (3, 2)
    assert coverage["summary"]["rows_validated_here"] == 3 and len(coverage["folders"]) == 2
    # a row the earlier file holds only as a summary, validated again: refused, not counted twice
    again = folder(tmp_path, "c", [verdict("o__r-1")])
    recorded = json.loads(results.read_text())
    recorded["coverage"]["verdicts"] = [v for v in recorded["coverage"]["verdicts"] if v["instance_id"] == "o__r-2"]
    results.write_text(json.dumps(recorded))
    with pytest.raises(SystemExit, match="o__r-1 validated again"):
        main(["--validation", str(again), "--tasks", str(tasks), "--results", str(results), "--previous"])
    # a row whose verdict the file kept can be validated again: the new verdict wins
    later = folder(tmp_path, "d", [verdict("o__r-2", valid=False)])
    assert main(["--validation", str(later), "--tasks", str(tasks), "--results", str(results), "--previous"]) == 0
    env = json.loads(results.read_text())["coverage"]["environments"]["o/r 1.0"]
    assert env["rows"]["o__r-2"] == "env_drift" and env["validated"]["instances"] == 3
