"""The `swectl` command line: one parser, one module per command (``add_parser`` + ``run``), one exit-code
mapping for every error a command raises."""

from __future__ import annotations

import argparse
import importlib
import sys

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

# command name -> module in swectl.cli (imported only when the command runs: `swectl --help` stays fast)
COMMANDS = {
    "up": "up",
    "check-config": "check_config",
    "nodes": "nodes",
    "image": "image",
    "tasks": "tasks",
    "eval": "eval",
    "data": "data",
    "model": "model",
}


def _command(name: str):
    return importlib.import_module(f"swectl.cli.{COMMANDS[name]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swectl", description="Train and evaluate software-engineering agents with RL.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        _command(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        try:
            return _command(args.command).run(args)
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


if __name__ == "__main__":
    sys.exit(main())
