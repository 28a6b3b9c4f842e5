"""just bench grade_real: swectl's grader against the official SWE-bench harness on real instances.

Takes a `swectl tasks validate` folder (validation.json, image-map.json) and picks validated instances round
robin over the repositories (while that validation still runs, as its instances are validated: ``--wait``;
Ctrl-C or kill reports the instances checked so far).
Per instance, three patches: gold, empty, and a wrong one (the gold patch's removals without its additions,
``swectl.tasks.diffs.drop_additions``: it applies and fixes nothing). Each patch is graded by swectl's Grader (a
fresh sandbox, concurrency 1) and by swebench 5.x's own ``run_instance`` through Podman's Docker-compatible API
on the same image, one instance after the other so both see the same load.

Writes benchmarks/results/grade_real.json: agreement (same verdict on every patch, the goal), each
disagreement with both graders' detail, grade p50 of both on the gold patches and the speedup, image build
time per instance (the validation run's builds, ``built``: this machine's caches as they were; and a rebuild
with warm caches, wheel pool and podman layers, of ``--rebuild K`` instances, forced) and disk per image.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import anyio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from common import Goal, host_meta, percentile, report, summarize  # noqa: E402

from swectl.actors.env_pool import running_pool  # noqa: E402
from swectl.actors.grader import Grader, GraderConfig, GradeResult  # noqa: E402
from swectl.config import load_config  # noqa: E402
from swectl.grading.official_harness import OfficialVerdict, grade_official  # noqa: E402
from swectl.images.names import ImageResolver  # noqa: E402
from swectl.tasks.diffs import drop_additions  # noqa: E402
from swectl.tasks.record import Task  # noqa: E402
from swectl.tasks.sources import load_tasks  # noqa: E402
from swectl.tasks.specs import load_specs  # noqa: E402

SUITE = "grade_real"
KINDS = ("gold", "empty", "wrong")


def patches(task: Task) -> dict[str, str]:
    return {"gold": task.patch, "empty": "", "wrong": drop_additions(task.patch)}


def candidates(validation: dict, tasks: dict[str, Task], exclude: set[str]) -> list[Task]:
    """The validated instances with a wrong patch to make, in id order."""
    out = []
    for v in sorted(validation["instances"], key=lambda v: v["instance_id"]):
        task = tasks.get(v["instance_id"])
        if v["valid"] and task is not None and task.repo not in exclude and drop_additions(task.patch):
            out.append(task)
    return out


def gold_seconds(folder: Path) -> dict[str, float]:
    """Each instance's longest gold grading in the validation run (grades.jsonl), seconds."""
    out: dict[str, float] = {}
    path = folder / "grades.jsonl"
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "gold":
            out[rec["instance_id"]] = max(out.get(rec["instance_id"], 0.0), rec["result"].get("duration_s", 0.0))
    return out


def next_instance(pool: list[Task], done: list[Task], seconds: dict[str, float]) -> Task | None:
    """The next instance to check: of the repository checked least so far (round robin over repositories), the
    one whose tests ran fastest in the validation (so that a 2-core machine gets through many repositories)."""
    seen = {t.instance_id for t in done}
    left = [t for t in pool if t.instance_id not in seen]
    if not left:
        return None
    count = {t.repo: sum(d.repo == t.repo for d in done) for t in left}
    return min(left, key=lambda t: (count[t.repo], seconds.get(t.instance_id, 1e9), t.instance_id))


async def grade_swectl(task: Task, images: dict[str, str], timeout_s: float) -> list[GradeResult]:
    config = load_config(None, ["env_pool.warm=0"])
    async with running_pool(config) as pool:
        grader = Grader(GraderConfig(concurrency=1, timeout_s=timeout_s), pool,
                        resolver=ImageResolver(mapping=images))
        out = [await grader.grade(task, patch, label=kind) for kind, patch in patches(task).items()]
    return out


def earlier_verdicts(tasks: dict[str, Task]) -> tuple[list[Task], list[dict]]:
    """The instances and verdict rows of the last report (results/grade_real.json), for ``--resume``; an instance
    the task set no longer has is left out with its rows."""
    from common import RESULTS_DIR

    path = RESULTS_DIR / f"{SUITE}.json"
    if not path.exists():
        return [], []
    meta = json.loads(path.read_text())["meta"]
    chosen = [tasks[i] for i in meta.get("instances", []) if i in tasks]
    kept = {t.instance_id for t in chosen}
    return chosen, [r for r in meta.get("verdicts", []) if r["instance_id"] in kept]


def verdict_row(task: Task, kind: str, ours: GradeResult, theirs: OfficialVerdict) -> dict:
    return {
        "instance_id": task.instance_id, "patch": kind, "swectl": ours.status, "swectl_reason": ours.reason,
        "swectl_f2p_failed": ours.f2p_failed[:10], "swectl_p2p_failed": ours.p2p_failed[:10],
        "swectl_s": round(ours.duration_s, 2), "swebench_resolved": theirs.resolved, "swebench_error": theirs.error,
        "swebench_s": theirs.seconds, "agree": ours.resolved == theirs.resolved,
    }


def rebuild_times(tasks: list[Task], k: int, repo_cache: Path) -> list[float]:
    """Seconds to rebuild k instance images with warm caches (forced: the content check alone is skipped)."""
    from swectl.images.instance import build_one

    specs, out = load_specs(), []
    for task in tasks[:k]:
        started = time.monotonic()
        outcome = build_one(task, specs, repo_cache, say=lambda _: None, force=True, allow_network=True)
        if outcome.ok:
            out.append(round(time.monotonic() - started, 2))
    return out


def disk_per_image(images: list[str]) -> dict[str, dict[str, int]]:
    """Bytes per instance image: all its layers, those above swectl's base image, and those no other of
    ``images`` shares (its own: the testbed and the install, and any dependency layer only it uses)."""
    from collections import Counter

    from swectl.images.builds import storage_root
    from swectl.images.project import DEFAULT_BASE
    from swectl.remote.nodes.podman import run_local_podman

    def layers(image: str) -> list[str]:
        out = run_local_podman("image", "inspect", "--format", "{{json .RootFS.Layers}}", image, timeout=60,
                               check=False)
        return json.loads(out.stdout.decode() or "[]") if out.exit_code == 0 else []

    table = json.loads((storage_root() / "overlay-layers" / "layers.json").read_text())
    size = {entry.get("diff-digest", ""): int(entry.get("diff-size") or 0) for entry in table}
    base = set(layers(DEFAULT_BASE))
    of = {image: layers(image) for image in images}
    users = Counter(d for ds in of.values() for d in set(ds))
    return {image: {"total": sum(size.get(d, 0) for d in ds),
                    "above_base": sum(size.get(d, 0) for d in ds if d not in base),
                    "unique": sum(size.get(d, 0) for d in ds if users[d] == 1)}
            for image, ds in of.items() if ds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validation", type=Path, required=True, help="a `swectl tasks validate` output folder")
    parser.add_argument("--tasks", default=None, help="the task set it validated (default: as recorded)")
    parser.add_argument("-n", type=int, default=24, help="instances (default 24)")
    parser.add_argument("--timeout", type=int, default=900, help="grading timeout per patch, seconds")
    parser.add_argument("--repo-cache", type=Path, default=None, help="rebuild --rebuild images from these clones")
    parser.add_argument("--rebuild", type=int, default=3, help="instances rebuilt with warm caches (default 3)")
    parser.add_argument("--exclude-repo", action="append", default=[], metavar="OWNER/NAME",
                        help="leave this repository's instances out (repeatable)")
    parser.add_argument("--wait", type=float, default=0.0,
                        help="seconds to wait for more validated instances while the validation goes on (default 0)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the verdicts of the last report (results/grade_real.json) and check -n instances "
                             "in all, adding new ones (their timings were measured then, under that run's load)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # kill (and a background run's only way): as Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job starts with SIGINT ignored
    tasks: dict[str, Task] = {}
    chosen: list[Task] = []
    rows: list[dict] = []
    host = host_meta()
    deadline = time.monotonic() + args.wait
    if args.resume:
        tasks = {t.instance_id: t for t in load_tasks(
            args.tasks or json.loads((args.validation / "validation.json").read_text())["tasks"]).tasks}
        chosen, rows = earlier_verdicts(tasks)
        print(f"resumed: {len(chosen)} instances checked before", file=sys.stderr)
    print(f"up to {args.n} validated instances, 3 patches each, both graders; load {host['loadavg_start']}",
          file=sys.stderr)
    try:
        while len(chosen) < args.n:
            # a validation still under way rewrites its reports as tasks finish: take what is validated by now
            validation = json.loads((args.validation / "validation.json").read_text())
            images = json.loads((args.validation / "image-map.json").read_text())
            tasks = tasks or {t.instance_id: t for t in load_tasks(args.tasks or validation["tasks"]).tasks}
            task = next_instance(candidates(validation, tasks, set(args.exclude_repo)), chosen,
                                 gold_seconds(args.validation))
            if task is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(30)
                continue
            jobs = list(patches(task).items())
            ours = anyio.run(grade_swectl, task, images, args.timeout)
            theirs = grade_official([(task, p) for _k, p in jobs], timeout_s=args.timeout, images=images,
                                    run_id=f"swectl-real-{os.getpid()}")
            chosen.append(task)
            rows += [verdict_row(task, kind, o, t) for (kind, _p), o, t in zip(jobs, ours, theirs, strict=True)]
            agree = all(r["agree"] for r in rows[-3:])
            said = [f"{r['patch']} {r['swectl']}/{'resolved' if r['swebench_resolved'] else 'unresolved'}"
                    for r in rows[-3:]]
            print(f"  [{len(chosen)}/{args.n}] {task.instance_id}: {', '.join(said)}"
                  + ("" if agree else "  DISAGREE"), file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # Ctrl-C: report the instances checked so far (one under way is left out)
        print(f"  interrupted: reporting the {len(chosen)} instances checked", file=sys.stderr)
    gold = [r for r in rows if r["patch"] == "gold"]
    ours_s = sorted(r["swectl_s"] for r in gold)
    theirs_s = sorted(r["swebench_s"] for r in gold)
    metrics: dict[str, float] = {
        "instances": len(chosen), "repos": len({t.repo for t in chosen}), "verdicts": len(rows),
        "agreement_frac": round(sum(r["agree"] for r in rows) / len(rows), 4) if rows else 0.0,
        "grade_p50_s": round(percentile(ours_s, 50), 3) if ours_s else 0.0,
        "swebench_grade_p50_s": round(percentile(theirs_s, 50), 3) if theirs_s else 0.0,
    }
    if metrics["grade_p50_s"]:
        metrics["speedup_vs_swebench"] = round(metrics["swebench_grade_p50_s"] / metrics["grade_p50_s"], 2)
    validation = json.loads((args.validation / "validation.json").read_text())  # as it stands now
    built = [v["build_s"] for v in validation["instances"] if v["build"] == "built"]
    if built:
        metrics["build_s_p50"] = round(percentile(sorted(built), 50), 1)
    warm = rebuild_times(chosen, args.rebuild, args.repo_cache) if args.repo_cache else []
    if warm:
        metrics["build_warm_s_p50"] = round(percentile(sorted(warm), 50), 1)
    disk = disk_per_image(sorted({v["image"] for v in validation["instances"] if v["build"] in ("built", "cached")}))
    if disk:
        for key in ("total", "above_base", "unique"):
            metrics[f"image_{key}_mb_p50"] = round(percentile(sorted(d[key] for d in disk.values()), 50) / 1e6, 1)
        metrics["images"] = len(disk)
        metrics["image_unique_mb_mean"] = round(sum(d["unique"] for d in disk.values()) / len(disk) / 1e6, 1)
    meta = {"validation": str(args.validation), "disk_bytes": disk, "host": host,
            "instances": [t.instance_id for t in chosen],
            "disagreements": [r for r in rows if not r["agree"]], "verdicts": rows,
            "swectl_gold_s": summarize(ours_s), "swebench_gold_s": summarize(theirs_s),
            "build_s": summarize(built), "build_warm_s": summarize(warm)}
    report(SUITE, metrics, meta, [Goal("agreement_frac", ">=", 1.0, text="== 1 (same verdict on every patch)"),
                                  Goal("instances", ">=", 20)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
