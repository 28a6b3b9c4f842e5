"""What every command module shares: the config arguments, the stderr status line and loading a --tasks set."""

from __future__ import annotations

import argparse
import ipaddress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swectl import logs
from swectl.errors import ConfigError, TaskDataError

if TYPE_CHECKING:
    from swectl.config import ClusterConfig
    from swectl.tasks.record import Task

SHOWN_SKIPPED_ROWS = 10


def is_loopback(host: str) -> bool:
    """Whether a --host to bind is reachable from this machine only."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_key_file(path: Path) -> str:
    """The key in an --api-key-file (stripped); ConfigError when it cannot be read or is empty."""
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read: {exc.strerror or exc}") from exc
    if not key:
        raise ConfigError(f"--api-key-file {path}: the file is empty")
    return key


def say(msg: str) -> None:
    """A status line on stderr (stdout stays for results)."""
    print(f"swectl: {msg}", file=logs.err(), flush=True)


def load_task_set(source: str) -> list[Task]:
    """The usable tasks of ``--tasks source``; skipped rows are named on stderr (the first few), and a set with no
    usable task is a TaskDataError that says why."""
    from swectl.images.harbor import with_harbor_prepared
    from swectl.tasks.sources import load_tasks

    loaded = with_harbor_prepared(load_tasks(source), say=say)  # Harbor task folders: images built, gold made
    for p in loaded.problems[:SHOWN_SKIPPED_ROWS]:
        say(f"skipped row {p.location}: {p.field}: {p.message}")
    if len(loaded.problems) > SHOWN_SKIPPED_ROWS:
        say(f"... and {len(loaded.problems) - SHOWN_SKIPPED_ROWS} more skipped rows")
    if not loaded.tasks:
        raise TaskDataError(_why_no_tasks(source, loaded.rows_read, len(loaded.problems)))
    return loaded.tasks


def _why_no_tasks(source: str, rows: int, problems: int) -> str:
    if rows == 0:
        return f"--tasks {source}: no task rows in it (an empty file or dataset split)"
    return (f"--tasks {source}: none of its {rows} rows is a usable task ({problems} malformed, listed above); "
            "is it a SWE-bench-style JSONL/JSON/parquet task file?")


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
    # a recipe phase's overlay of the config, as values (swectl/cli/phases.py): on the file, under the --sets
    parser.set_defaults(config_overlay=None)


def load_run_config(path: str | Path | None, overrides: list[str],
                    overlay: dict[str, Any] | None = None) -> ClusterConfig:
    """The config of a command that runs episodes: `load_config`, then the files it names that the config layer
    does not read (rollout.agent_config's templates), so a wrong one stops the command before any work starts."""
    from swectl.agent.protocol import agent_templates
    from swectl.config import load_config

    config = load_config(path, overrides, overlay)
    agent_templates(config.rollout.agent_config)
    return config


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
