"""The `swectl` command line."""

from __future__ import annotations

import argparse
import sys

import anyio

from swectl.config import load_config, resolved_json
from swectl.errors import ConfigError, InfraError, SwectlError, TaskDataError

EPILOG = """\
examples:
  swectl up                              run the embedded default (one local node)
  swectl up examples/two-nodes.toml --set env_pool.warm=8
  swectl check-config cluster.toml       print the resolved config as JSON
  swectl nodes check cluster.toml        connect to every node and report problems
  swectl image build                     build the bundled project images (offline, cached)
  swectl tasks synth --out tasks.jsonl   synthesise tasks from the bundled projects
  swectl eval --gold                     validate the bundled tasks: every gold patch must resolve
  swectl eval --predictions preds.jsonl --tasks tasks.jsonl
  swectl data prepare tasks.jsonl --out data/   prompt JSONL for slime/miles + the image list
  swectl model init                      create the tiny Qwen3 policy (tokenizer trained on local code)
"""


def _config_args(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    parser.add_argument(
        "config", nargs=None if required else "?", metavar="FILE",
        help="cluster config (TOML)" + ("" if required else "; default: the embedded default, one local node"),
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set env_pool.warm=8 or --set nodes.0.max_running=64 "
        "(values parse as TOML; repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swectl", description="Train and evaluate software-engineering agents with RL.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run the main job on a cluster (today: the sandbox layer end to end)")
    _config_args(up)
    up.add_argument("--episodes", type=int, default=8, help="scripted episodes to run (default 8)")
    up.add_argument("--concurrency", type=int, default=4, help="episodes at once (default 4)")

    check = sub.add_parser("check-config", help="validate a config and print it resolved, as JSON")
    _config_args(check)

    nodes = sub.add_parser("nodes", help="inspect and clean container nodes")
    nodes_sub = nodes.add_subparsers(dest="nodes_command", required=True, metavar="ACTION")
    nodes_check = nodes_sub.add_parser(
        "check", help="connect to every node; report podman version, images, disk, swectl containers, problems"
    )
    _config_args(nodes_check)
    nodes_check.add_argument("--json", action="store_true", help="print the reports as JSON")

    from swectl.cli_tasks import add_eval_command, add_image_commands, add_tasks_commands
    from swectl.data_prepare import add_data_commands
    from swectl.model_init import add_model_commands

    add_image_commands(sub)
    add_tasks_commands(sub, _config_args)
    add_eval_command(sub, _config_args)
    add_data_commands(sub)
    add_model_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        try:
            return _run(args)
        except BaseExceptionGroup as group:  # a task group's failure: report the error inside it
            leaf = _first_swectl_error(group)
            if leaf is None:
                raise
            raise leaf from group
    except ConfigError as exc:
        print(f"swectl: config error: {exc}", file=sys.stderr)
        return 2
    except TaskDataError as exc:
        print(f"swectl: task data error: {exc}", file=sys.stderr)
        return 2
    except InfraError as exc:
        print(f"swectl: infrastructure error: {exc}", file=sys.stderr)
        return 3
    except SwectlError as exc:
        print(f"swectl: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("swectl: interrupted; containers of this run were removed", file=sys.stderr)
        return 130


def _first_swectl_error(group: BaseExceptionGroup) -> SwectlError | None:
    """The first SwectlError among the group's leaves, when every leaf is one (or a cancellation)."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [group]
    while pending:
        exc = pending.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            pending[:0] = list(exc.exceptions)
        else:
            leaves.append(exc)
    errors = [leaf for leaf in leaves if isinstance(leaf, SwectlError)]
    if not errors or any(not isinstance(leaf, SwectlError | KeyboardInterrupt) for leaf in leaves):
        return None
    return errors[0]


def _run(args: argparse.Namespace) -> int:
    match args.command:
        case "image":
            from swectl.cli_tasks import run_image_command

            return run_image_command(args)
        case "data":
            from swectl.data_prepare import run_data_command

            return run_data_command(args)
        case "model":
            from swectl.model_init import run_model_command

            return run_model_command(args)
    config = load_config(args.config, args.overrides)
    match args.command:
        case "tasks":
            from swectl.cli_tasks import run_tasks_command

            return run_tasks_command(args, config)
        case "eval":
            from swectl.cli_tasks import run_eval_command

            return run_eval_command(args, config)
        case "check-config":
            sys.stdout.write(resolved_json(config).decode() + "\n")
            return 0
        case "up":
            from swectl.up import run_up

            return anyio.run(lambda: run_up(config, episodes=args.episodes, concurrency=args.concurrency))
        case "nodes":
            return _nodes(args, config)
    return 1


def _nodes(args: argparse.Namespace, config) -> int:
    import msgspec

    from swectl.nodes_check import check_nodes, format_reports

    reports = anyio.run(check_nodes, config)
    if args.json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(reports)).decode() + "\n")
    else:
        print(format_reports(reports))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
