"""`swectl tasks synth`: SWE-smith-style tasks from real projects (swectl/synth/); `swectl tasks validate`: which
tasks of a set can be trusted; `swectl tasks export --harbor`: a task set as Harbor task folders
(swectl/eval/harbor_export.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio
import msgspec

from swectl.cli.common import config_args, say
from swectl.config import load_config
from swectl.images.project import BUNDLED_PROJECTS, build_project_image, load_projects
from swectl.tasks.record import Task


def add_parser(sub: argparse._SubParsersAction) -> None:
    tasks = sub.add_parser("tasks", help="make task sets")
    tsub = tasks.add_subparsers(dest="tasks_command", required=True, metavar="ACTION")
    synth = tsub.add_parser(
        "synth",
        help="synthesise SWE-smith-style tasks from real projects: mutate covered functions, keep mutants that "
        "break 1..N tests",
    )
    config_args(synth)
    synth.add_argument("--projects", type=Path, default=BUNDLED_PROJECTS, help="projects file (TOML)")
    synth.add_argument("--only", action="append", default=[], metavar="NAME", help="only this project")
    synth.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same tasks)")
    synth.add_argument("--max-tasks", type=int, default=10, help="tasks kept per project (default 10)")
    synth.add_argument("--max-candidates", type=int, default=80, help="mutants tried per project (default 80)")
    synth.add_argument("--per-function", type=int, default=3, help="mutants sampled per function (default 3)")
    synth.add_argument("--max-fail", type=int, default=30, help="keep a mutant if 1..N tests fail (default 30)")
    synth.add_argument("--concurrency", type=int, default=2, help="sandboxes running mutants at once")
    synth.add_argument("--out", type=Path, default=Path("tasks.jsonl"), help="output JSONL (default tasks.jsonl)")

    export = tsub.add_parser(
        "export",
        help="write a task set as Harbor task folders that Harbor runs unmodified (its oracle agent applies the gold "
        "patch, its verifier runs the task's tests)",
        description="Write each task of --tasks as a Harbor task folder under --harbor DIR: task.toml,\n"
        "instruction.md, environment/Dockerfile (FROM the task's image on this machine, its setup patch committed),\n"
        "tests/test.sh "
        "(the task's eval script, then SWE-bench's FAIL_TO_PASS / PASS_TO_PASS rule on pytest's results -> reward 1\n"
        "or 0 in /logs/verifier/reward.txt) and solution/solve.sh (the gold patch). Harbor tasks are copied as they\n"
        "are. Rows graded by a parser other than pytest's are skipped with the reason. Run them with Harbor, e.g.\n"
        "  harbor run -p DIR -a oracle -e podman --no-delete",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("--tasks", default=None, metavar="SOURCE",
                        help="task set: JSONL/JSON/parquet, a Harbor task folder, or an HF name (default: the bundled "
                        "set)")
    export.add_argument("--harbor", required=True, type=Path, metavar="DIR", help="the folder to write the tasks to")
    export.add_argument("--instances", nargs="+", default=[], metavar="ID", help="only these instance ids")
    export.add_argument("--slice", default="", metavar="A:B", help="only tasks[A:B] (after --instances)")
    export.add_argument("--image-map", type=Path, default=None, metavar="FILE",
                        help="JSON/TOML instance_id -> image (as swectl eval)")
    export.add_argument("--image-template", default=None, metavar="T", help="image name template (as swectl eval)")
    export.add_argument("--timeout", type=float, default=1800.0, help="the verifier's timeout, seconds")

    validate = tsub.add_parser(
        "validate",
        help="find the tasks of a set whose environment can be trusted: build each image, grade gold (several runs) "
        "and empty, and give every other task one reason",
        description="Build each task's image (--repo-cache: classic SWE-bench rows from local clones), grade its gold "
        "patch --runs times and the empty patch once, each in a fresh sandbox. Validated: gold resolves in every "
        "run and empty does not. Every other task gets one reason: build_failed (and the step), infra, timeout, "
        "gold_patch_failed, gold_tampered (the grader's defences called gold tampered), flaky (which tests), "
        "network, cpu_count, missing_library (which), "
        "missing_dependency (which, and whether the fix imports it), other_python (the spec's Python is not on "
        "the node), env_drift (which tests) or empty_resolves. "
        "Writes validation.json (per task, per repository), validated.txt (the ids), image-map.json and "
        "grades.jsonl (a rerun with the same --out grades only what is missing).",
    )
    config_args(validate)
    validate.add_argument("--tasks", required=True, metavar="SOURCE", help="task set: JSONL/JSON/parquet or HF name")
    validate.add_argument("--runs", type=int, default=3, help="gold runs per task, to find flaky tests (default 3)")
    validate.add_argument("--repo-cache", type=Path, default=None, metavar="DIR",
                          help="build the classic SWE-bench rows' images from local clones in DIR (as `swectl image "
                          "build --repo-cache`); without it every task runs the image its row, --image-map or "
                          "--image-template names")
    validate.add_argument("--jobs", type=int, default=1, metavar="N", help="images built at once (default 1)")
    validate.add_argument("--concurrency", type=int, default=2, help="gradings at once (default 2)")
    validate.add_argument("--timeout", type=float, default=1800.0, help="grading timeout per run, seconds")
    validate.add_argument("--allow-network", action="store_true",
                          help="let image builds use the network (the specs' apt and pip pre-install steps)")
    validate.add_argument("--uploaded-prior-to", default="official", metavar="POLICY",
                          help="date policy of the builds' downloads (see `swectl image build --help`)")
    validate.add_argument("--instances", nargs="+", default=[], metavar="ID", help="only these instance ids")
    validate.add_argument("--slice", default="", metavar="A:B", help="only tasks[A:B] (after --instances)")
    validate.add_argument("--repos", nargs="+", default=[], metavar="REPO",
                          help="only the tasks of these repositories (owner/name), before --per-version")
    validate.add_argument("--per-version", type=int, default=0, metavar="N",
                          help="up to N tasks of every (repository, version) environment, spread over its rows "
                               "(the same file gives the same picks), after --instances and --slice; the report "
                               "and the table then go per environment")
    validate.add_argument("--prune", action="store_true",
                          help="remove each image this --out built once its task's verdict is made (and the "
                               "environment's images with its last task), so a large set fits the disk; at most "
                               "--jobs + 1 built images wait for gradings; a rerun with the same --out keeps the "
                               "verdicts made (verdicts.jsonl) and builds only the rest")
    validate.add_argument("--image-map", type=Path, default=None, metavar="FILE",
                          help="JSON/TOML instance_id -> image for the tasks not built here")
    validate.add_argument("--image-template", default=None, metavar="T", help="image name template (as swectl eval)")
    validate.add_argument("--out", type=Path, default=None,
                          help="output folder (default runs/validate-<time>); an existing one resumes")


def run(args: argparse.Namespace) -> int:
    if args.tasks_command == "validate":
        return _validate(args)
    if args.tasks_command == "export":
        return _export(args)
    config = load_config(args.config, args.overrides)
    from swectl.synth.factory import SynthConfig, synth_project

    projects = load_projects(args.projects)
    chosen = [p for p in projects.project if not args.only or p.name in args.only]
    cfg = SynthConfig(seed=args.seed, max_tasks=args.max_tasks, max_candidates=args.max_candidates,
                      per_function=args.per_function, max_fail=args.max_fail, concurrency=args.concurrency)
    built = {p.name: build_project_image(p, projects.runner, say=say) for p in chosen}
    config = msgspec.structs.replace(config, env_pool=msgspec.structs.replace(config.env_pool, warm=0))

    async def main() -> list[Task]:
        from swectl.actors.env_pool import running_pool

        out: list[Task] = []
        async with running_pool(config) as pool:
            for p in chosen:
                tasks, _stats = await synth_project(pool, p, built[p.name], cfg, say=say)
                out.extend(tasks)
        return out

    tasks = anyio.run(main)
    tasks.sort(key=lambda t: t.instance_id)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(b"".join(msgspec.json.encode(t.row()) + b"\n" for t in tasks))
    say(f"wrote {len(tasks)} tasks to {args.out}")
    return 0 if tasks else 1


def _export(args: argparse.Namespace) -> int:
    """``swectl tasks export --harbor``: 0 when every chosen task was written, 1 when some were skipped."""
    from swectl.cli.common import load_task_set
    from swectl.cli.eval import select_tasks
    from swectl.errors import TaskDataError
    from swectl.eval.harbor_export import export_task
    from swectl.images.names import ImageResolver
    from swectl.images.project import BUNDLED_TASKS

    tasks = select_tasks(load_task_set(args.tasks or str(BUNDLED_TASKS)), args.instances, args.slice)
    resolver = ImageResolver.from_options(args.image_template, args.image_map)
    args.harbor.mkdir(parents=True, exist_ok=True)
    written, skipped = 0, 0
    for task in tasks:
        try:
            export_task(task, resolver.resolve(task), args.harbor, timeout_s=args.timeout)
            written += 1
        except TaskDataError as exc:
            say(f"skipped {task.instance_id}: {exc}")
            skipped += 1
    say(f"wrote {written} Harbor task folders to {args.harbor}" + (f" ({skipped} skipped)" if skipped else ""))
    return 0 if not skipped else 1


def _validate(args: argparse.Namespace) -> int:
    import time

    from swectl.cli.common import load_task_set, output_dir
    from swectl.cli.eval import select_tasks
    from swectl.errors import ConfigError, SwectlError
    from swectl.eval.validate import format_validation, pick_per_version, validate_tasks, write_validation
    from swectl.images.instance import (
        InstanceOutcome,
        build_one,
        prune_unused_base_images,
        remove_base_image,
        remove_instance_image,
    )
    from swectl.images.names import ImageResolver
    from swectl.images.wheels import check_date_policy
    from swectl.logs import write_run_log
    from swectl.tasks.specs import load_specs

    if args.runs < 1 or args.jobs < 1 or args.concurrency < 1:
        raise ConfigError("--runs, --jobs and --concurrency must be at least 1")
    config = load_config(args.config, args.overrides)
    config = msgspec.structs.replace(config, env_pool=msgspec.structs.replace(config.env_pool, warm=0))
    tasks = select_tasks(load_task_set(args.tasks), args.instances, args.slice)
    if args.repos:
        unknown = sorted(set(args.repos) - {t.repo for t in tasks})
        if unknown:
            raise ConfigError(f"--repos: no task of {', '.join(unknown)} in the selection (its repositories: "
                              f"{', '.join(sorted({t.repo for t in tasks})[:20])})")
        tasks = [t for t in tasks if t.repo in set(args.repos)]
    if args.per_version < 0:
        raise ConfigError("--per-version must be at least 1 (0: every task)")
    if args.per_version:
        tasks = pick_per_version(tasks, args.per_version)
    out = output_dir(args.out or Path(config.out_dir) / f"validate-{time.strftime('%Y%m%d-%H%M%S')}")
    write_run_log(out)
    resolver = ImageResolver.from_options(args.image_template, args.image_map)
    policy = check_date_policy(args.uploaded_prior_to)
    specs = load_specs() if args.repo_cache is not None else None

    def build(task: Task) -> InstanceOutcome | None:
        if specs is None or task.image or task.eval_script or task.instance_id in resolver.mapping:
            return None
        return build_one(task, specs, args.repo_cache, say=say, allow_network=args.allow_network,
                         uploaded_prior_to=policy)

    def prune(outcome: InstanceOutcome, environment_done: bool) -> None:
        # the environment's images go with its last task (the Python images stay: a few, shared by every
        # environment of their Python). Best effort: an image left costs disk, never a verdict or the run.
        removed: list[str] = []
        try:
            removed += [outcome.image] if remove_instance_image(outcome.image) else []
            # its own, not a sweep: another environment's may be under a build with no name yet. The apt images
            # (shared by environments with the same apt steps) go at the end: one just built has no child until
            # its environment's build starts, and a sweep removed it from under that build (xarray 2022.09)
            if environment_done and outcome.env and remove_base_image(outcome.env):
                removed.append(outcome.env)
        except SwectlError as exc:
            say(f"{outcome.instance_id}: warning: pruning stopped ({exc}); the images left stay until "
                "`swectl image prune --instances`")
        say(f"{outcome.instance_id}: pruned {', '.join(removed) or 'nothing'}")

    say(f"validating {len(tasks)} tasks: gold x{args.runs} and empty, {args.jobs} build(s) and "
        f"{args.concurrency} grading(s) at once, output {out}" + (", pruning as it goes" if args.prune else ""))
    report = anyio.run(lambda: validate_tasks(config, tasks, out, build=build, runs=args.runs,
                                              concurrency=args.concurrency, jobs=args.jobs, timeout_s=args.timeout,
                                              resolver=resolver, tasks_source=str(args.tasks),
                                              prune=prune if args.prune else None))
    if args.prune:  # every build is over: the apt images nothing stands on any more
        try:
            if swept := prune_unused_base_images(("apt",)):
                say(f"pruned {', '.join(swept)}")
        except SwectlError as exc:
            say(f"warning: pruning the apt images stopped ({exc})")
    print(format_validation(report, versions=bool(args.per_version)))
    for path in write_validation(report, out):
        say(f"wrote {path}")
    if report.eval_only:
        say("these rows are SWE-bench Verified, an evaluation set: validated.txt is for evaluation only; never train "
            "on them")
    say(f"{report.validated}/{report.total} tasks validated")
    return 0 if report.validated == report.total else 1
