"""What every command module shares: the config arguments and the stderr status line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from swectl.errors import ConfigError


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


def output_dir(path: str | Path, knob: str = "--out") -> Path:
    """``path`` as a folder that exists (created with its parents), or a ConfigError naming ``knob``."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{knob} {folder}: exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".swectl-write-test-{id(folder)}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{knob} {folder}: cannot write there: {exc.strerror or exc}") from exc
    return folder
