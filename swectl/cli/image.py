"""`swectl image build | prune`: project images of the bundled set, instance images from local clones."""

from __future__ import annotations

import argparse
from pathlib import Path

from swectl.cli.common import say
from swectl.errors import ConfigError
from swectl.images.project import BUNDLED_PROJECTS, build_project_image, load_projects, project_content, prune_images


def add_parser(sub: argparse._SubParsersAction) -> None:
    image = sub.add_parser("image", help="build, list and prune the images task sets run in")
    isub = image.add_subparsers(dest="image_command", required=True, metavar="ACTION")
    build = isub.add_parser(
        "build", help="build project images offline (pinned sdists; cached by content: unchanged inputs are reused)"
    )
    build.add_argument("--projects", type=Path, default=BUNDLED_PROJECTS,
                       help=f"projects file (TOML; default: the bundled set, {BUNDLED_PROJECTS.name})")
    build.add_argument("--only", action="append", default=[], metavar="NAME",
                       help="build only this project (with --repo-cache: only this instance id)")
    build.add_argument("--force", action="store_true", help="rebuild even when the content hash matches")
    build.add_argument("--repo-cache", type=Path, default=None, metavar="DIR",
                       help="build instance images for the classic SWE-bench rows of --tasks from local clones in DIR "
                       "(DIR/owner__name, DIR/owner/name or DIR/name), offline, with the SWE-bench 4.1.0 specs")
    build.add_argument("--tasks", default=None, metavar="SOURCE", help="task set for --repo-cache (file or HF name)")
    build.add_argument("--image-map", type=Path, default=None, metavar="FILE",
                       help="with --repo-cache: write instance_id -> image JSON for `swectl eval --image-map`")
    build.add_argument("--allow-network", action="store_true",
                       help="with --repo-cache: let builds use the network (runs the specs' apt/pip pre-install steps; "
                       "apt steps from the base image's Debian mirror, in an apt image of their own)")
    build.add_argument("--uploaded-prior-to", default="official", metavar="POLICY",
                       help="with --repo-cache: resolve unpinned requirements with releases uploaded before a date: "
                       "official (2024-08-13, when SWE-bench Verified was validated; default), created_at (the row's), "
                       "env-commit (its environment_setup_commit's), none, or an ISO date")
    build.add_argument("--jobs", type=int, default=1, metavar="N",
                       help="with --repo-cache: images built at once (default 1; each build runs pip and podman, so "
                       "more than the node's cores only queues)")
    prune = isub.add_parser("prune", help="remove swectl project images that no projects file describes any more")
    prune.add_argument("--projects", type=Path, default=BUNDLED_PROJECTS, help="projects whose images to keep")
    prune.add_argument("--all", action="store_true", help="remove every swectl project image")
    prune.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    prune.add_argument("--instances", action="store_true",
                       help="prune instance images instead (`image build --repo-cache`): every one, or with --tasks "
                       "those of rows not in the set; then the environment, apt and Python images no instance image is "
                       "built on any more")
    prune.add_argument("--tasks", default=None, metavar="SOURCE",
                       help="with --instances: the rows whose images to keep")


def run(args: argparse.Namespace) -> int:
    if args.image_command == "build" and args.repo_cache is not None:
        return _build_instance_images(args)
    if args.image_command == "prune" and args.instances:
        return _prune_instance_images(args)
    projects = load_projects(args.projects)
    if args.image_command == "build":
        chosen = [p for p in projects.project if not args.only or p.name in args.only]
        for i, p in enumerate(chosen, 1):
            built = build_project_image(p, projects.runner, force=args.force, say=say)
            state = "cached" if built.cached else "built"
            say(f"[{i}/{len(chosen)}] {built.image} {state} (content {built.content}, "
                 f"commit {built.base_commit[:10]})")
        return 0
    keep: set[str] = set()
    if not args.all:
        for p in projects.project:
            keep.add(f"{p.image}@{project_content(p, projects.runner)}")
    removed = prune_images(keep, dry_run=args.dry_run)
    say(("would remove" if args.dry_run else "removed") + f" {len(removed)} image(s): {', '.join(removed) or '-'}")
    return 0


def _build_instance_images(args: argparse.Namespace) -> int:
    from swectl.images.instance import build_instance_images, write_image_map
    from swectl.tasks.sources import load_tasks
    from swectl.tasks.specs import load_specs

    if not args.tasks:
        raise ConfigError("--repo-cache needs --tasks SOURCE (the rows whose images to build)")
    tasks = load_tasks(args.tasks).tasks
    if args.only:
        tasks = [t for t in tasks if t.instance_id in set(args.only)]
    outcomes = build_instance_images(tasks, load_specs(), args.repo_cache, say=say, force=args.force,
                                     allow_network=args.allow_network, uploaded_prior_to=args.uploaded_prior_to,
                                     jobs=args.jobs)
    for o in outcomes:
        where = f" in {o.step}" if o.step else ""
        say(f"{o.instance_id}: {o.status}{where} {o.image} {o.message}".rstrip())
    if args.image_map:
        write_image_map(outcomes, args.image_map)
        say(f"wrote {args.image_map}")
    failed = [o for o in outcomes if o.status == "failed"]
    envs = {o.env for o in outcomes if o.ok and o.env}
    made = sum(o.env_built for o in outcomes)
    say(f"{len(outcomes) - len(failed)}/{len(outcomes)} instance images ready, on {len(envs)} environment image(s) "
        f"({made} built now)")
    return 1 if failed else 0


def _prune_instance_images(args: argparse.Namespace) -> int:
    from swectl.images.instance import prune_instance_images
    from swectl.tasks.sources import load_tasks

    keep = {t.instance_id for t in load_tasks(args.tasks).tasks} if args.tasks else None
    removed = prune_instance_images(keep, dry_run=args.dry_run)
    say(("would remove" if args.dry_run else "removed") + f" {len(removed)} image(s): {', '.join(removed) or '-'}")
    return 0
