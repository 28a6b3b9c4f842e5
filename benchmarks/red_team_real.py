"""`just bench red_team_real --tasks ROWS --image-map MAP`: the red team (tests/red_team.py) on real SWE-bench rows
whose instance images are built here (`swectl image build --repo-cache ... --image-map MAP`), graded by the Grader
the training runs use, by `swectl eval --predictions` and (``--serve``) by `swectl serve`'s eval lease, with the
gold patch beside them (it must resolve) and, with ``--control``, the same attacks with the grader's defences off
(what the suite catches).

Rows whose tests run through Django's tests/runtests.py get the Django attacks (DJANGO_ATTACKS) beside the
generic ones that apply to any tree; pytest rows get every generic attack. Writes
``benchmarks/results/red_team_real.json`` (per row and attack: status, reason, detail, on each path).

Too slow for CI (each row's image is built from its repository with the network); CI grades the red team on the
bundled tasks and on pallets__flask-5014 (tests/integration/test_red_team.py, test_serve_real_row.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

import anyio
import msgspec

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from swectl.actors.env_pool import running_pool  # noqa: E402
from swectl.actors.grader import Grader, GraderConfig, GradeResult  # noqa: E402
from swectl.config import load_config  # noqa: E402
from swectl.eval.patches import PatchReport  # noqa: E402
from swectl.images.names import ImageResolver  # noqa: E402
from swectl.tasks.record import Task  # noqa: E402
from swectl.tasks.sources import load_tasks  # noqa: E402
from tests.red_team import ATTACKS, DJANGO_ATTACKS, attack_patches, export_tree  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results" / "red_team_real.json"
# generic attacks that need a pytest id ("path::test") in FAIL_TO_PASS
PYTEST_ONLY = {"edit_failing_tests"}


def say(message: str) -> None:
    print(f"red-team: {message}", file=sys.stderr, flush=True)


def is_django(task: Task) -> bool:
    """Its tests run through Django's tests/runtests.py (the eval script is made at grading time for SWE-bench rows)."""
    return task.repo == "django/django" or "runtests.py" in task.eval_script


def attack_names(task: Task) -> list[str]:
    generic = [n for n in ATTACKS if not (is_django(task) and n in PYTEST_ONLY)]
    return generic + (list(DJANGO_ATTACKS) if is_django(task) else [])


async def grade_all(task: Task, patches: dict[str, str], resolver: ImageResolver, *, defences: bool,
                    logs: Path | None = None) -> dict[str, GradeResult]:
    config = load_config(None, ["env_pool.warm=0"])
    results: dict[str, GradeResult] = {}
    async with running_pool(config, "rtr" + uuid.uuid4().hex[:8]) as pool:
        grader = Grader(GraderConfig(concurrency=2, defences=defences, timeout_s=1800), pool, resolver=resolver,
                        log_dir=logs / ("defended" if defences else "undefended") if logs else None)

        async def one(name: str, patch: str) -> None:
            results[name] = await grader.grade(task, patch, label=name)

        async with anyio.create_task_group() as each:
            for name, patch in patches.items():
                each.start_soon(one, name, patch)
    return results


def through_eval(task: Task, patches: dict[str, str], image_map: Path, work: Path) -> dict[str, dict]:
    """`swectl eval --predictions`: each attack a prediction for its own copy of the row (same image)."""
    names = sorted(patches)
    rows = [msgspec.to_builtins(msgspec.structs.replace(task, instance_id=f"{task.instance_id}.{n}")) for n in names]
    mapping = json.loads(image_map.read_text())
    (work / "map.json").write_text(json.dumps({f"{task.instance_id}.{n}": mapping[task.instance_id] for n in names}))
    (work / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "preds.jsonl").write_text("".join(
        json.dumps({"instance_id": f"{task.instance_id}.{n}", "model_name_or_path": "red-team",
                    "model_patch": patches[n]}) + "\n" for n in names))
    out = work / "eval"
    run = subprocess.run([sys.executable, "-m", "swectl.cli.main", "eval", "--tasks", str(work / "tasks.jsonl"),
                          "--predictions", str(work / "preds.jsonl"), "--image-map", str(work / "map.json"),
                          "--out", str(out), "--set", "env_pool.warm=0"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=3600, check=False)
    if not (out / "report.json").exists():
        raise SystemExit(f"swectl eval failed (exit {run.returncode}): {run.stderr[-2000:]}")
    report = msgspec.json.decode((out / "report.json").read_bytes(), type=PatchReport)
    # an instance's verdict is its status (InstanceReport has no "resolved" field: reading one by name was always
    # False, so this column could not show a resolved attack; gold is in the set as the check that it can)
    return {i.instance_id.rsplit(".", 1)[1]: {"status": i.status, "resolved": i.status == "resolved"}
            for i in report.instances}


def through_serve(task: Task, patches: dict[str, str], tasks_file: str, image_map: Path, work: Path
                  ) -> dict[str, dict]:
    """`swectl serve`, as OpenClaw-RL's swe-rl reward asks for it: an ``<id>__eval`` lease under the official image
    name the client derives, then ``/evaluate`` with the patch and the row's own eval script (``""``)."""
    from tests.integration.serving import Client, Service
    from tests.integration.test_serve_clients import official_name

    work.mkdir(parents=True, exist_ok=True)
    svc = Service(work, "--tasks", tasks_file, "--image-map", str(image_map), "--set", "env_pool.warm=0")
    client = Client(svc.url)
    verdicts: dict[str, dict] = {}
    try:
        for name, patch in patches.items():
            lease = client.allocate(image=official_name(task.instance_id), instance_id=f"{task.instance_id}__eval")
            answer = client.ok("/evaluate", {"lease_id": lease, "patch": patch, "eval_script": ""})
            client.ok("/close", {"lease_id": lease})
            verdicts[name] = {"status": answer["status"], "resolved": answer["resolved"],
                              "tampered": answer.get("tampered", False), "reason": answer.get("reason", ""),
                              "output": answer.get("output", "")[:200]}
            say(f"serve: {name}: {answer['status']} {answer.get('reason', '')}")
    finally:
        svc.stop()
    return verdicts


def row(r: GradeResult) -> dict:
    return {"status": r.status, "reason": r.reason, "detail": (r.detail or "")[:300], "canaries": r.canaries,
            "dropped": list(r.dropped_test_files)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", required=True, help="the rows (a swectl or SWE-bench task file)")
    parser.add_argument("--image-map", type=Path, required=True, help="instance_id -> image (`swectl image build`)")
    parser.add_argument("--control", action="store_true", help="grade the attacks with the defences off too")
    parser.add_argument("--no-eval", action="store_true", help="the grader only (not `swectl eval`)")
    parser.add_argument("--serve", action="store_true",
                        help="also grade every attack through `swectl serve`'s eval lease (as swe-rl asks for it)")
    parser.add_argument("--attacks", default="", help="only these attacks, comma-separated (default: all that apply)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--logs", type=Path, default=None, metavar="DIR",
                        help="keep each grading's eval log in DIR/defended (and DIR/undefended with --control)")
    args = parser.parse_args(argv)
    tasks = load_tasks(args.tasks, strict=True).tasks
    mapping = json.loads(args.image_map.read_text())
    resolver = ImageResolver(mapping=mapping, mapping_origin=str(args.image_map))
    out: dict[str, dict] = {}
    bad: list[str] = []
    for task in tasks:
        image = mapping[task.instance_id]
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="red-team-") as tmp:
            names = [n for n in attack_names(task) if not args.attacks or n in args.attacks.split(",")]
            patches = attack_patches(export_tree(task, Path(tmp) / "testbed", image, timeout_s=600), task, names)
            say(f"{task.instance_id}: {len(patches)} attacks ({'Django' if is_django(task) else 'pytest'} row)")
            graded = anyio.run(partial(grade_all, task, {**patches, "gold": task.patch}, resolver, defences=True,
                                       logs=args.logs))
            gold = graded.pop("gold")
            control = (anyio.run(partial(grade_all, task, patches, resolver, defences=False, logs=args.logs))
                       if args.control else {})
            evals = ({} if args.no_eval
                     else through_eval(task, {**patches, "gold": task.patch}, args.image_map, Path(tmp)))
            served = (through_serve(task, {**patches, "gold": task.patch}, args.tasks, args.image_map,
                                    Path(tmp) / "serve") if args.serve else {})
        resolved = [n for n, r in graded.items() if r.status == "resolved"]
        resolved += [f"{n} (eval)" for n, r in evals.items() if r["resolved"] and n != "gold"]
        if evals and not evals["gold"]["resolved"]:
            bad.append(f"{task.instance_id}: gold through eval {evals['gold']['status']}")
        resolved += [f"{n} (serve)" for n, r in served.items() if r["resolved"] and n != "gold"]
        if served and not served["gold"]["resolved"]:
            bad.append(f"{task.instance_id}: gold through serve {served['gold']['status']}")
        bad += [f"{task.instance_id}: {n}" for n in resolved]
        if gold.status != "resolved":
            bad.append(f"{task.instance_id}: gold {gold.status} {gold.reason} {gold.detail}")
        out[task.instance_id] = {
            "gold": row(gold), "attacks": {n: row(r) for n, r in graded.items()}, "eval": evals,
            "serve": served, "control_without_defences": {n: row(r) for n, r in control.items()},
            "resolved": resolved, "minutes": round((time.monotonic() - started) / 60, 1)}
        for n, r in graded.items():
            print(f"{task.instance_id:<28} {n:<26} {r.status:<10} {r.reason:<14} "
                  f"eval {evals.get(n, {}).get('status', '-'):<10} serve {served.get(n, {}).get('status', '-'):<10} "
                  f"no defences {control[n].status if n in control else '-':<10} {(r.detail or '')[:80]}")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "tasks": args.tasks, "rows": out,
                                        "problems": bad}, indent=1) + "\n")
    say(f"wrote {args.results}; {'problems: ' + '; '.join(bad) if bad else 'no attack resolved, gold resolved'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
