"""The run's checkpoints and records on disk (docs/architecture.md 8.7).

    <run>/checkpoints/step_000010/trainer/         model, optimizer, scheduler, RNG (written by the ranks)
    <run>/checkpoints/step_000010/controller.json  step, weight version, data cursor, weights folder
    <run>/checkpoints/latest                       "step_000010", written last

Every file is written under a temporary name and renamed, and ``latest`` only moves once the whole checkpoint
is in place: a checkpoint that was interrupted (a kill, a full disk) is never taken as the latest.
``steps.jsonl`` records each step's tasks; on resume the lines after the checkpoint's step are dropped, so the
records of a resumed run read as one run with no task repeated or skipped.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import msgspec

from swectl.actors.data_source import DataCursor
from swectl.errors import ConfigError

LATEST = "latest"
STATE_FORMAT = 1


class RunState(msgspec.Struct, kw_only=True):
    """The controller's half of a checkpoint."""

    format_version: int = STATE_FORMAT
    step: int = 0  # optimizer steps done
    weights: str = ""  # the weights the engines serve after ``step`` (a HF folder)
    cursor: DataCursor = msgspec.field(default_factory=DataCursor)
    sft_cursor: DataCursor = msgspec.field(default_factory=DataCursor)
    skipped_steps: list[int] = []


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / step_name(step)


def commit_checkpoint(run_dir: Path, state: RunState) -> Path:
    """Write the controller state beside the trainer's (already in place) and move ``latest`` to it."""
    folder = checkpoint_dir(run_dir, state.step)
    if not (folder / "trainer" / "trainer.json").is_file():
        raise ConfigError(f"{folder}: the trainer's half of the checkpoint is missing")
    write_atomic(folder / "controller.json", msgspec.json.format(msgspec.json.encode(state)))
    write_atomic(run_dir / "checkpoints" / LATEST, step_name(state.step).encode())
    return folder


def latest_checkpoint(run_dir: Path) -> tuple[Path, RunState] | None:
    """The latest complete checkpoint of a run, or None when it has none."""
    pointer = run_dir / "checkpoints" / LATEST
    if not pointer.is_file():
        return None
    folder = run_dir / "checkpoints" / pointer.read_text().strip()
    try:
        state = msgspec.json.decode((folder / "controller.json").read_bytes(), type=RunState)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{folder}: the latest checkpoint is unreadable ({exc}); remove {pointer} to start the "
                          "run over, or point it at an earlier checkpoint") from exc
    return folder, state


def prune_weights(run_dir: Path, keep: int, protected: set[str]) -> None:
    """Delete weight folders beyond the ``keep`` newest, except ``protected`` ones (checkpointed, served)."""
    folders = sorted(p for p in (run_dir / "weights").glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in folders[:-keep] if keep else folders:
        if str(old) not in protected and old.name not in protected:
            shutil.rmtree(old, ignore_errors=True)


def truncate_records(path: Path, after_step: int) -> None:
    """Drop JSONL records whose ``step`` is beyond ``after_step`` (they were not checkpointed)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_bytes().splitlines():
        try:
            if json.loads(line).get("step", 0) <= after_step:
                kept.append(line)
        except (ValueError, AttributeError):
            continue
    write_atomic(path, b"".join(line + b"\n" for line in kept))
