"""What every command module shares: the config arguments and the stderr status line."""

from __future__ import annotations

import argparse
import sys


def say(msg: str) -> None:
    """A status line on stderr (stdout stays for results)."""
    print(f"swectl: {msg}", file=sys.stderr, flush=True)


def config_args(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    """The cluster config FILE and the generic ``--set KEY=VALUE`` overrides."""
    parser.add_argument(
        "config", nargs=None if required else "?", metavar="FILE",
        help="cluster config (TOML)" + ("" if required else "; default: the embedded default, one local node"),
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. --set env_pool.warm=8 or --set nodes.0.max_running=64 "
        "(values parse as TOML; repeatable)",
    )
