"""The `swectl` command line: one parser, one module per command (``add_parser`` + ``run``), one exit-code
mapping for every error a command raises, and one way a command is stopped.

Ctrl-C (SIGINT), SIGTERM (what ``kill``, Slurm, systemd and Kubernetes send) and SIGHUP (the terminal went
away) all stop a command the same way: the running command is cancelled, its cleanup runs (each actor's
shutdown is shielded and bounded: containers and engine servers of the run are removed), and ``swectl``
exits 130. A signal the process inherited as ignored (``nohup``, a background job's SIGINT) stays ignored.
A second signal during cleanup stops at once; the containers it leaves are reaped by the next run started from
this machine (they carry the dead controller's host and pid).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Iterator

from swectl import logs
from swectl.errors import ConfigError, InfraError, SwectlError, TaskDataError

EPILOG = """\
examples:
  swectl up                              the first run on one local node: tiny model, SFT, GRPO, readings
  swectl up examples/two-nodes.toml --set env_pool.warm=8
  swectl check-config cluster.toml       print the resolved config as JSON
  swectl nodes check cluster.toml        connect to every node and report problems
  swectl image build                     build the bundled project images (offline, cached)
  swectl tasks synth --out tasks.jsonl   synthesise tasks from the bundled projects
  swectl eval --gold                     validate the bundled tasks: every gold patch must resolve
  swectl eval --predictions preds.jsonl --tasks tasks.jsonl
  swectl data prepare tasks.jsonl --out data/   prompt JSONL for slime/miles + the image list
  swectl model init                      create the tiny Qwen3 policy (tokenizer trained on local code)
  swectl eval --model runs/models/tiny-qwen3 --slice 0:4   run the agent with it and grade
  swectl serve --port 18090               the sandbox fleet over HTTP for slime / OpenClaw-RL swe-rl rollouts
  swectl gateway --model runs/m          the policy token-exact to a harness you run (OpenAI, Anthropic APIs)
  swectl plot runs/train-1               draw a training run's learning curves into runs/train-1/plots/
  swectl view runs/train-1               look at a run in a browser: curves, tasks, every episode
  swectl -v eval --gold                  also print what happens inside the run (restarts, retries, ...)
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
    "plot": "plot",
    "serve": "serve",
    "gateway": "gateway",
    "view": "view",
}
# signals that stop a command like Ctrl-C does
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
EXIT_INTERRUPTED = 130
# The one mapping from errors to exit codes, most specific first: (error class, message label, exit code).
EXIT_CODES: tuple[tuple[type[SwectlError], str, int], ...] = (
    (ConfigError, "config error: ", 2),
    (TaskDataError, "task data error: ", 2),
    (InfraError, "infrastructure error: ", 3),
    (SwectlError, "", 1),
)


def command_module(name: str):
    """The module of swectl command ``name`` (its ``add_parser`` and ``run``)."""
    return importlib.import_module(f"swectl.cli.{COMMANDS[name]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swectl", description="Train and evaluate software-engineering agents with RL.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="count", default=0,
                           help="print what happens inside a run (info; -vv: debug) besides warnings; "
                           f"a run's output folder gets it all in {logs.RUN_LOG}")
    verbosity.add_argument("-q", "--quiet", action="store_true",
                           help=f"log only errors to the terminal (a run's {logs.RUN_LOG} still gets everything)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        command_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with logs.configure(-1 if args.quiet else args.verbose), _stop_signals_interrupt():
        try:
            return _run_command(args)
        except SwectlError as exc:
            label, code = next((label, code) for kind, label, code in EXIT_CODES if isinstance(exc, kind))
            print(f"swectl: {label}{exc}", file=sys.stderr)
            return code
        except KeyboardInterrupt:
            print(f"swectl: {interrupted_message(args)}", file=sys.stderr)
            return EXIT_INTERRUPTED


def _run_command(args: argparse.Namespace) -> int:
    """The parsed command run; a task group's failure raised as the error inside it (a stop as KeyboardInterrupt,
    whatever failed on the way out)."""
    try:
        return command_module(args.command).run(args)
    except BaseExceptionGroup as group:
        if group.subgroup(KeyboardInterrupt) is not None:
            raise KeyboardInterrupt from group
        leaf = _first_swectl_error(group)
        if leaf is None:
            raise
        raise leaf from group


def interrupted_message(args: argparse.Namespace) -> str:
    """What an interrupted command has left behind: true for the command that was stopped."""
    match args.command:
        case "eval" if any(getattr(args, a, None) for a in ("model", "endpoint", "openai_url")):
            return ("interrupted; the containers of this run were removed and any engine servers it started "
                    "stopped; to resume, run the same command with --out set to this run's output folder (finished "
                    "episodes are kept)")
        case "up" | "tasks" | "eval" | "serve":
            return "interrupted; the containers of this run were removed"
        case "image" if getattr(args, "image_command", "") == "sync":
            return ("interrupted; no image is half there on any node (one counts only once its pull completed); run "
                    "the same command again: it moves only what is still missing")
        case "model":
            return "interrupted; the model folder is moved into place only when complete, so it was not written"
        case _:
            return "interrupted"


@contextlib.contextmanager
def _stop_signals_interrupt() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP do what Ctrl-C does (unless they were inherited ignored).

    The handler calls whatever handles SIGINT at that moment: inside ``anyio.run`` that is asyncio's
    Runner, which cancels the main task so every cleanup runs; elsewhere it is Python's default, which
    raises KeyboardInterrupt. When SIGINT itself is ignored (a background job), KeyboardInterrupt is raised
    directly: the event loop then cancels every task on its way out, which runs the same cleanup."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can handle signals
        return

    def as_sigint(signum: int, frame: object) -> None:
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    saved = {}
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            saved[sig] = signal.signal(sig, as_sigint)
    try:
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)


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
