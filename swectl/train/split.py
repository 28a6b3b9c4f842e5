"""The seeded train/held-out split of a run's tasks, made once and recorded in split.json: the one place that loads the
task source (Harbor task folders prepared), splits it and writes or checks the record. `swectl up`'s plan (plan.py)
and a recipe's ``[split]`` (swectl/cli/phases.py) both call it, so a run folder has one kind of split.json."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec

from swectl.actors.data_source import split_tasks
from swectl.errors import ConfigError, TaskDataError
from swectl.tasks.record import Task

Say = Callable[[str], None]
SPLIT_FILE = "split.json"


class SplitRecord(msgspec.Struct, frozen=True, kw_only=True):
    """split.json: which tasks a run trains on and which it holds out, written when the run starts."""

    tasks: str
    test_fraction: float
    split_seed: int
    train: list[str]
    held_out: list[str]


class Split(msgspec.Struct, frozen=True, kw_only=True):
    """The tasks of each side and the record that says which they are."""

    train: list[Task]
    held_out: list[Task]
    record: SplitRecord


def split_source(source: str, test_fraction: float, split_seed: int, *, key: str, say: Say) -> Split:
    """The usable tasks of ``source`` (a file, folder or Harbor tasks: their images built and gold patches made,
    which can take minutes: call it off the event loop), split by ``split_seed``. ``key`` names the setting that
    gave ``source`` in the errors; skipped rows are said."""
    from swectl.images.harbor import with_harbor_prepared
    from swectl.tasks.sources import load_tasks

    loaded = with_harbor_prepared(load_tasks(source), say=say)
    for problem in loaded.problems:
        say(f"skipped task {problem.location}: {problem.field}: {problem.message}")
    if not loaded.tasks:
        raise TaskDataError(f"{key} {source}: no usable task in it")
    train, held_out = split_tasks(loaded.tasks, test_fraction, split_seed)
    return Split(train=train, held_out=held_out, record=SplitRecord(
        tasks=source, test_fraction=test_fraction, split_seed=split_seed,
        train=[task.instance_id for task in train], held_out=[task.instance_id for task in held_out]))


async def split_source_off_loop(source: str, test_fraction: float, split_seed: int, *, key: str, say: Say) -> Split:
    """``split_source`` in a worker thread: the phases beside it (a recipe run's siblings) go on meanwhile."""
    return await anyio.to_thread.run_sync(
        lambda: split_source(source, test_fraction, split_seed, key=key, say=say))


def record_split(path: Path, split: SplitRecord, *, settings: str) -> None:
    """Write ``split`` to ``path``, or, when the run already has one (a resume), refuse a different split: the
    run would go on training on tasks it held out before. ``settings`` names the keys that make the split."""
    if path.is_file():
        try:
            before = msgspec.json.decode(path.read_bytes(), type=SplitRecord)
        except msgspec.DecodeError as e:
            raise ConfigError(f"{path}: not a split record ({e}); move it away to start the split afresh") from e
        if (sorted(before.train), sorted(before.held_out)) != (sorted(split.train), sorted(split.held_out)):
            moved = sorted(set(split.train) - set(before.train))
            raise ConfigError(
                f"{path}: this run started with another train/held-out split ({len(before.train)} train / "
                f"{len(before.held_out)} held out; now {len(split.train)} / {len(split.held_out)}, "
                f"{len(moved)} task(s) would move into training, e.g. {moved[:3]}); {settings} changed since (the "
                f"seed was {before.split_seed}, now {split.split_seed})")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(split), indent=1) + b"\n")
