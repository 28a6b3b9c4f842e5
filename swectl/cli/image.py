"""`swectl image build | prune | push | sync`: project images of the bundled set, instance images from local clones;
publishing a task set's images to a registry and pulling them onto the config's nodes."""

from __future__ import annotations

import argparse
from pathlib import Path

from swectl.cli.common import config_args, say
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
    push = isub.add_parser(
        "push", help="publish images to a registry the nodes pull from (`image sync`): a task set's images with the "
        "environment image under each, or every environment and instance image built here")
    push.add_argument("--registry", required=True, metavar="URL", help=REGISTRY_HELP)
    push.add_argument("--tasks", default=None, metavar="SOURCE",
                      help="push the images of these tasks (default: every environment and instance image built here)")
    _image_name_args(push)
    sync = isub.add_parser(
        "sync", help="make the images of a task set present on every node of the config (the env pool's): each node "
        "pulls what it lacks from a registry it reaches (--registry), or the controller sends it (the default); a "
        "per-node table at the end (exit 1 when an image is missing anywhere); run again after a stop, it moves only "
        "what is missing")
    sync.add_argument("--tasks", required=True, metavar="SOURCE", help="the task set whose images the nodes need")
    source = sync.add_mutually_exclusive_group()
    source.add_argument("--registry", default=None, metavar="URL", help=REGISTRY_HELP)
    source.add_argument("--from-controller", action="store_true",
                        help="send the images from this machine, for nodes that reach no registry (the default when "
                        "no --registry is given): a registry of its own on 127.0.0.1 (Debian's docker-registry), "
                        "pushed to first, each SSH node pulling through a port forwarded over its SSH connection")
    sync.add_argument("--cache", type=Path, default=Path("runs/image-cache"), metavar="DIR",
                      help="from the controller: its registry keeps the pushed layers here, so a later sync pushes "
                      "only what changed (default runs/image-cache; delete it to reclaim the disk)")
    config_args(sync)
    _image_name_args(sync)
    sync.add_argument("--per-node", type=int, default=2, metavar="N", help="pulls at once on one node (default 2)")
    sync.add_argument("--jobs", type=int, default=8, metavar="N", help="pulls at once across the nodes (default 8)")
    sync.add_argument("--pull-timeout", type=float, default=1800.0, metavar="S",
                      help="seconds one pull (or push to the controller's registry) may take (default 1800)")
    sync.add_argument("--json", action="store_true", help="print the report as JSON (stdout) instead of the table")


REGISTRY_HELP = ("the registry: http://HOST:PORT[/PREFIX] for a plain-HTTP one (no TLS: a private network or tests "
                 "only), https://HOST[:PORT][/PREFIX] or HOST[:PORT][/PREFIX] for TLS with verified certificates")


def _image_name_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--image-map", default=None, metavar="FILE",
                        help="instance_id -> image (JSON or TOML), as for swectl eval")
    parser.add_argument("--image-template", default=None, metavar="T", help="image name template, as for swectl eval")


def run(args: argparse.Namespace) -> int:
    if args.image_command == "push":
        return _push(args)
    if args.image_command == "sync":
        return _sync(args)
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


def _push(args: argparse.Namespace) -> int:
    from swectl.cli.common import load_task_set
    from swectl.images.names import ImageResolver
    from swectl.images.push import built_images, push_images, task_images, with_environments
    from swectl.images.registry import parse_registry

    registry = parse_registry(args.registry)
    if args.tasks:
        resolver = ImageResolver.from_options(args.image_template, args.image_map)
        images = with_environments(task_images(load_task_set(args.tasks), resolver))
    else:
        images = built_images()
    if not images:
        say("no images to push (none built here: swectl image build --repo-cache ...)")
        return 0
    outcomes = push_images(images, registry, say=say)
    failed = [o for o in outcomes if not o.ok]
    say(f"pushed {len(outcomes) - len(failed)}/{len(outcomes)} image(s) to {registry.url}")
    return 1 if failed else 0


def _sync(args: argparse.Namespace) -> int:
    import sys

    import anyio
    import msgspec

    from swectl.cli.common import load_task_set
    from swectl.config import load_config
    from swectl.images.from_controller import sync_from_controller
    from swectl.images.names import ImageResolver
    from swectl.images.push import task_images
    from swectl.images.registry import parse_registry
    from swectl.images.sync import SyncOptions, SyncReport, SyncTarget, format_report, sync_images
    from swectl.remote.nodes.backends import close_backends, make_backends
    from swectl.remote.nodes.node import LocalNode
    from swectl.remote.nodes.podman import PodmanCli

    registry = parse_registry(args.registry) if args.registry is not None else None
    try:
        options = SyncOptions(per_node=args.per_node, total=args.jobs, pull_timeout_s=args.pull_timeout)
    except ValueError as exc:
        raise ConfigError(f"--per-node / --jobs: {exc}") from exc
    config = load_config(args.config, args.overrides)
    resolver = ImageResolver.from_options(args.image_template, args.image_map)
    images = task_images(load_task_set(args.tasks), resolver)

    async def main() -> SyncReport:
        backends = make_backends(config)  # each node's images are in its backend's container store
        targets = [SyncTarget(backend.name, backend.cli) for _, backend in backends]
        try:
            if registry is None:
                return await sync_from_controller(targets, images, controller=PodmanCli(LocalNode("controller")),
                                                  cache=args.cache, options=options, say=say)
            return await sync_images(targets, images, registry, options=options, say=say)
        finally:
            await close_backends(backends)

    source = registry.url if registry is not None else f"the controller (its registry's cache: {args.cache})"
    say(f"{len(images)} image(s) onto {len(config.sandbox_nodes())} node(s) from {source}")
    report = anyio.run(main)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(report)).decode() + "\n")
    else:
        print(format_report(report))
    return 0 if report.ok else 1
