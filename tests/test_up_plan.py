"""`swectl up`'s plan: the train/held-out split is seeded by train.data.split_seed alone and recorded in split.json,
and a resume that would split differently is refused before anything trains."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from swectl.config import load_config
from swectl.errors import ConfigError
from swectl.train.plan import build_plan


def _plan(tmp_path: Path, run_dir: Path, *sets: str):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")  # a grpo plan without sft_steps only checks that the folder is a model
    config = load_config(None, [f"train.model='{model}'", *sets])
    return anyio.run(lambda: build_plan(config, run_dir, say=print))


def _ids(tasks) -> list[str]:
    return sorted(t.instance_id for t in tasks)


def test_the_training_seed_does_not_move_the_split(tmp_path: Path) -> None:
    a = _plan(tmp_path, tmp_path / "a", "train.seed=0")
    b = _plan(tmp_path, tmp_path / "b", "train.seed=1")
    assert _ids(a.train_tasks) == _ids(b.train_tasks) and _ids(a.test_tasks) == _ids(b.test_tasks)
    assert a.test_tasks and not set(_ids(a.train_tasks)) & set(_ids(a.test_tasks))
    c = _plan(tmp_path, tmp_path / "c", "train.data.split_seed=1")
    assert _ids(c.train_tasks) != _ids(a.train_tasks)
    record = json.loads((tmp_path / "a" / "split.json").read_text())
    assert record["split_seed"] == 0 and sorted(record["train"]) == _ids(a.train_tasks)
    assert sorted(record["held_out"]) == _ids(a.test_tasks)


def test_a_resume_with_another_split_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _plan(tmp_path, run)
    again = _plan(tmp_path, run, "train.seed=5")  # the same split: accepted
    assert _ids(again.train_tasks) == _ids(first.train_tasks)
    with pytest.raises(ConfigError, match=r"another train/held-out split.*split_seed changed since"):
        _plan(tmp_path, run, "train.data.split_seed=3")
    (run / "split.json").write_text("not json")
    with pytest.raises(ConfigError, match="not a split record"):
        _plan(tmp_path, run)


def test_a_recipe_split_writes_the_same_record_as_a_run(tmp_path: Path) -> None:
    """The first-run recipe's [split] and `swectl up`'s plan write one kind of split.json (swectl/train/split.py),
    and the recipe's train.jsonl / test.jsonl hold the tasks the record names."""
    import msgspec

    from swectl.cli.phases import _split
    from swectl.train.recipe import load
    from swectl.train.split import SplitRecord

    recipe = load("first-run", {})
    run = tmp_path / "recipe-run"
    run.mkdir()
    anyio.run(lambda: _split(recipe, run, print))
    record = msgspec.json.decode((run / "split.json").read_bytes(), type=SplitRecord)
    assert record.train and record.held_out and not set(record.train) & set(record.held_out)
    for name, ids in (("train", record.train), ("test", record.held_out)):
        rows = [json.loads(line) for line in (run / f"{name}.jsonl").read_text().splitlines()]
        assert sorted(row["instance_id"] for row in rows) == sorted(ids)
    planned = json.loads((run / "split.json").read_text())
    _plan(tmp_path, tmp_path / "up-run")
    assert set(json.loads((tmp_path / "up-run" / "split.json").read_text())) == set(planned)
