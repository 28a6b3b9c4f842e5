"""SWE-bench Verified's environments as `swectl tasks validate` found them (issue 61): one row per (repository,
version) environment of the dataset, from the validation folders given, into ``results/swebench_validation.json``
under ``coverage`` (the other keys stay).

The validation runs that feed it (resumable: the same --out again keeps the verdicts made):

    swectl tasks validate --tasks ../shared/data/swe_bench_verified.jsonl --repo-cache CACHE --allow-network \\
        --per-version 2 --prune --runs 1 --out runs/verified-coverage [--repos OWNER/NAME ...]
    python benchmarks/verified_coverage.py --validation runs/verified-coverage [--validation OTHER ...]
    python benchmarks/verified_coverage.py --previous --validation NEW ...   # on top of the recorded coverage

``--previous`` is for a machine that lacks the folders behind the recorded table (runs/ is not kept): the table's
rows stay, and the new folders' verdicts are added. From 2026-12-08 the results file keeps every verdict
(``coverage.verdicts``), so later rows can be validated again; the rows recorded before that are summaries only.

Per environment: the dataset's rows, the rows validated here (built, gold resolved, empty resolved, validated, the
reasons), the seconds a task took (build plus gradings), and each row's verdict. Environments of repositories whose
clones cannot be brought here are listed apart (UNREACHABLE). The goals checked: gold resolves on >= 98% of the
built rows of every repository, empty on none, and the ten environments with the most Verified rows at 100%; and
no gold patch graded tampered (a false positive of the grader's defences).
A row validated by several folders keeps the verdict of the folder given last.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS_DIR, format_table, host_meta
from swectl.eval.validate import (
    InstanceValidation,
    RepoValidation,
    ValidationReport,
    build_validation_report,
    environment_key,
)

DEFAULT_TASKS = Path(__file__).resolve().parents[2] / "shared" / "data" / "swe_bench_verified.jsonl"
UNREACHABLE = {  # repositories whose mirrors exceed the fetch limit here (524,288,000 bytes): no clone, no image
    "matplotlib/matplotlib": "its mirror (872,960,000 bytes) exceeds the fetch limit (524,288,000; 2026-12-07)",
    "scikit-learn/scikit-learn": "its mirror (788,428,800 bytes) exceeds the fetch limit (524,288,000; 2026-12-07)",
}
GOAL_GOLD_FRAC = 0.98
TOP_ENVIRONMENTS = 10


class CoverageRow(msgspec.Struct, kw_only=True):
    """One environment: how many rows the dataset has, and what validation found on the ones it ran."""

    environment: str
    dataset_rows: int
    reachable: bool
    why_not: str = ""
    validated: RepoValidation | None = None  # None: no row of it validated yet
    rows: dict[str, str] = {}  # instance id -> "validated" or the reason


def dataset_environments(tasks: Path) -> Counter[str]:
    """Rows per environment key in a SWE-bench-format JSONL file."""
    counts: Counter[str] = Counter()
    for line in tasks.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            counts[f"{row['repo']} {row['version']}"] += 1
    return counts


def merged_verdicts(folders: list[Path]) -> list[InstanceValidation]:
    """The verdicts of every folder's validation.json (the folder given last wins for a row in several)."""
    by_id: dict[str, InstanceValidation] = {}
    for folder in folders:
        path = folder / "validation.json"
        if not path.exists():
            raise SystemExit(f"{path}: no such file (is {folder} a `swectl tasks validate --out` folder?)")
        report = msgspec.json.decode(path.read_bytes(), type=ValidationReport)
        by_id.update({v.instance_id: v for v in report.instances})
    return sorted(by_id.values(), key=lambda v: v.instance_id)


def merged_summary(a: RepoValidation, b: RepoValidation, sign: int = 1) -> RepoValidation:
    """Two disjoint sets of rows' summaries as one (counts added, fractions and the mean time made again); with
    ``sign=-1``, ``a`` without the rows of ``b`` (a part of it)."""
    n = a.instances + sign * b.instances
    reasons = Counter(a.reasons)
    for k, v in b.reasons.items():
        reasons[k] += sign * v
    out = RepoValidation(
        instances=n, built=a.built + sign * b.built, gold_resolved=a.gold_resolved + sign * b.gold_resolved,
        empty_resolved=a.empty_resolved + sign * b.empty_resolved, validated=a.validated + sign * b.validated,
        reasons=dict(sorted((k, v) for k, v in reasons.items() if v > 0)),
        seconds_per_task=round((a.seconds_per_task * a.instances + sign * b.seconds_per_task * b.instances) / n, 1)
        if n else 0.0)
    out.built_frac = round(out.built / n, 4) if n else 0.0
    out.gold_resolved_frac = round(out.gold_resolved / out.built, 4) if out.built else 0.0
    out.empty_resolved_frac = round(out.empty_resolved / out.built, 4) if out.built else 0.0
    return out


def previous_coverage(path: Path) -> tuple[dict[str, CoverageRow], list[InstanceValidation], list[str]]:
    """The coverage recorded in a results file: its environments' rows, the verdicts it kept (from 2026-12-08 on),
    and the gold patches it found tampered."""
    recorded = json.loads(path.read_text()).get("coverage") or {}
    rows = {k: msgspec.convert(v, CoverageRow) for k, v in (recorded.get("environments") or {}).items()}
    verdicts = msgspec.convert(recorded.get("verdicts") or [], list[InstanceValidation])
    return rows, verdicts, list((recorded.get("summary") or {}).get("gold_tampered") or [])


def with_previous(rows: list[CoverageRow], previous: dict[str, CoverageRow],
                  kept: list[InstanceValidation]) -> list[CoverageRow]:
    """``rows`` (from verdicts) with the rows of ``previous`` that it did not keep verdicts of (``kept``; recorded as
    a summary only, before the verdicts were kept) added to their environment's counts. A row both there and here:
    here wins where ``previous`` kept its verdict; otherwise it is a summary that cannot be taken apart, so the
    verdict here is refused."""
    kept_ids = {v.instance_id for v in kept}
    kept_summary = build_validation_report(kept, tasks="", runs=0, elapsed_s=0.0).versions
    out = []
    for row in rows:
        before = previous.get(row.environment)
        old = {i: r for i, r in (before.rows if before else {}).items() if i not in kept_ids}
        if before is None or before.validated is None or not old:
            out.append(row)
            continue
        if clash := sorted(set(old) & set(row.rows)):
            raise SystemExit(f"{row.environment}: {', '.join(clash)} validated again, but the earlier verdict is a "
                             "summary only: validate rows the results file does not name")
        summary_only = before.validated
        if row.environment in kept_summary:
            summary_only = merged_summary(summary_only, kept_summary[row.environment], sign=-1)
        validated = merged_summary(summary_only, row.validated) if row.validated else summary_only
        out.append(msgspec.structs.replace(row, validated=validated, rows=dict(sorted({**old, **row.rows}.items()))))
    return out


def coverage_rows(environments: Counter[str], verdicts: list[InstanceValidation]) -> list[CoverageRow]:
    report = build_validation_report(verdicts, tasks="", runs=0, elapsed_s=0.0)
    rows = []
    for key in sorted(environments):
        repo = key.split(" ")[0]
        rows.append(CoverageRow(
            environment=key, dataset_rows=environments[key], reachable=repo not in UNREACHABLE,
            why_not=UNREACHABLE.get(repo, ""), validated=report.versions.get(key),
            rows={v.instance_id: "validated" if v.valid else (v.reason or "?")
                  for v in verdicts if environment_key(v) == key}))
    return rows


def goals(rows: list[CoverageRow], verdicts: list[InstanceValidation],
          gold_tampered: list[str] | None = None) -> dict[str, Any]:
    """Coverage of the reachable environments, and the issue's goals on what was validated (per repository, from
    its environments' counts; ``gold_tampered``: found so by an earlier results file)."""
    reachable = [r for r in rows if r.reachable]
    covered = [r for r in reachable if r.validated]
    repos: dict[str, RepoValidation] = {}
    for r in covered:
        repo = r.environment.split(" ")[0]
        repos[repo] = merged_summary(repos[repo], r.validated) if repo in repos else r.validated
    top = sorted(reachable, key=lambda r: (-r.dataset_rows, r.environment))[:TOP_ENVIRONMENTS]
    return {
        "reachable_environments": len(reachable),
        "covered_environments": len(covered),
        "not_covered": [r.environment for r in reachable if not r.validated],
        "rows_validated_here": sum(r.validated.instances for r in covered),
        "repos_gold_resolved_frac": {repo: s.gold_resolved_frac for repo, s in sorted(repos.items())},
        "repos_below_goal": sorted(repo for repo, s in repos.items()
                                   if s.built and s.gold_resolved_frac < GOAL_GOLD_FRAC),
        "empty_resolved": sum(s.empty_resolved for s in repos.values()),
        # a gold patch the grader's defences call tampered is a false positive of theirs (issue 56, part 4)
        "gold_tampered": sorted({*(gold_tampered or []), *(v.instance_id for v in verdicts if "tampered" in v.gold)}),
        "top_environments": {r.environment: (r.validated.gold_resolved_frac if r.validated else None) for r in top},
    }


def table(rows: list[CoverageRow]) -> str:
    lines = []
    for r in rows:
        s = r.validated
        reasons = ", ".join(f"{k} {n}" for k, n in sorted(s.reasons.items())) if s else ""
        lines.append([r.environment, str(r.dataset_rows),
                      "-" if not r.reachable else str(s.instances) if s else "0",
                      f"{s.built}" if s else "", f"{s.gold_resolved}" if s else "", f"{s.empty_resolved}" if s else "",
                      f"{s.validated}" if s else "", f"{s.seconds_per_task:.0f}" if s else "",
                      r.why_not or reasons])
    return format_table(["environment", "rows", "tried", "built", "gold", "empty", "valid", "s/task", "reasons"],
                        lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--validation", type=Path, action="append", required=True, metavar="DIR",
                    help="a `swectl tasks validate --out` folder (repeatable; the last wins for a row in several)")
    ap.add_argument("--tasks", type=Path, default=DEFAULT_TASKS, help=f"the dataset (default {DEFAULT_TASKS})")
    ap.add_argument("--command", default="", help="the validate command line(s), recorded with the table")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR / "swebench_validation.json")
    ap.add_argument("--previous", action="store_true",
                    help="add to the coverage --results holds (its rows stay; the folders' verdicts come on top): "
                         "for folders of an earlier machine that are gone")
    args = ap.parse_args(argv)
    if not args.tasks.exists():
        raise SystemExit(f"--tasks {args.tasks}: no such file")
    previous: dict[str, CoverageRow] = {}
    kept: list[InstanceValidation] = []
    tampered: list[str] = []
    if args.previous:
        if not args.results.exists():
            raise SystemExit(f"--previous: {args.results} does not exist")
        previous, kept, tampered = previous_coverage(args.results)
    fresh = merged_verdicts(args.validation)
    by_id = {v.instance_id: v for v in [*kept, *fresh]}  # a verdict made here wins over a kept one
    verdicts = sorted(by_id.values(), key=lambda v: v.instance_id)
    rows = with_previous(coverage_rows(dataset_environments(args.tasks), verdicts), previous, kept)
    print(table(rows))
    summary = goals(rows, verdicts, tampered)
    print(json.dumps(summary, indent=1))
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    results["coverage"] = {
        "what": "per (repository, version) environment of SWE-bench Verified: rows in the dataset, rows validated "
                "here and their verdicts (benchmarks/verified_coverage.py; issue 61)",
        "host": host_meta(),
        "command": "; then ".join(c for c in [results.get("coverage", {}).get("command", "") if args.previous
                                              else "", args.command] if c),
        "folders": [*(results.get("coverage", {}).get("folders", []) if args.previous else []),
                    *(str(f) for f in args.validation)],
        "summary": summary,
        "environments": {r.environment: msgspec.to_builtins(r) for r in rows},
        "verdicts": msgspec.to_builtins(verdicts),  # kept, so that a later --previous can take rows apart
    }
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.results} (coverage)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
