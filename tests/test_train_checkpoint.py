"""Checkpoint bookkeeping: `latest` moves only when a checkpoint is whole; records are truncated on resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swectl.actors.data_source import DataCursor
from swectl.errors import ConfigError
from swectl.train.checkpoint import (
    RunState,
    checkpoint_dir,
    commit_checkpoint,
    latest_checkpoint,
    prune_weights,
    truncate_records,
)


def _trainer_half(run: Path, step: int) -> None:
    folder = checkpoint_dir(run, step) / "trainer"
    folder.mkdir(parents=True)
    (folder / "trainer.json").write_text("{}")


def test_latest_moves_only_after_both_halves(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    _trainer_half(tmp_path, 2)
    commit_checkpoint(tmp_path, RunState(step=2, cursor=DataCursor(epoch=1, index=3, consumed=["a", "b"])))
    folder, state = latest_checkpoint(tmp_path)
    assert folder.name == "step_000002" and state.cursor.consumed == ["a", "b"] and state.cursor.index == 3
    # a checkpoint whose trainer half is missing (killed mid-save, disk full) is refused and latest stays
    checkpoint_dir(tmp_path, 4).mkdir(parents=True)
    with pytest.raises(ConfigError, match="trainer's half"):
        commit_checkpoint(tmp_path, RunState(step=4))
    assert latest_checkpoint(tmp_path)[1].step == 2


def test_an_unreadable_latest_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    _trainer_half(tmp_path, 1)
    commit_checkpoint(tmp_path, RunState(step=1))
    (checkpoint_dir(tmp_path, 1) / "controller.json").write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        latest_checkpoint(tmp_path)


def test_truncate_records_drops_steps_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)) + "garbage\n")
    truncate_records(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_prune_keeps_the_newest_and_protected_weights(tmp_path: Path) -> None:
    for s in range(1, 6):
        (tmp_path / "weights" / f"step_{s:06d}").mkdir(parents=True)
    prune_weights(tmp_path, 2, {"step_000001"})
    left = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert left == ["step_000001", "step_000004", "step_000005"]


def test_a_redone_group_gets_a_fresh_folder_and_the_abandoned_one_is_kept_aside(tmp_path: Path) -> None:
    """After a restart or resume the feed draws its groups under the same names again: the abandoned attempt's
    folder (its episodes and rewards.jsonl) moves to abandoned/, so the redo's rewards never sit beside it."""
    from swectl.train.rollouts import fresh_folder

    group = tmp_path / "episodes" / "group_000186"
    (group / "task__0").mkdir(parents=True)
    (group / "rewards.jsonl").write_text('{"instance_id": "task", "sample": 0, "reward": 1.0}\n')
    assert fresh_folder(tmp_path, group) == group and not group.exists()
    kept = tmp_path / "abandoned" / "episodes" / "group_000186.1"
    assert (kept / "rewards.jsonl").read_text().startswith('{"instance_id": "task"') and (kept / "task__0").is_dir()
    group.mkdir()
    fresh_folder(tmp_path, group)
    assert (tmp_path / "abandoned" / "episodes" / "group_000186.2").is_dir() and kept.is_dir()
    assert fresh_folder(tmp_path, tmp_path / "episodes" / "group_000187") == tmp_path / "episodes" / "group_000187"
