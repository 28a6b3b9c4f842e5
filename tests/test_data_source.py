"""DataSource: seeded epochs, a cursor that resumes without repeating or skipping, the train/test split."""

from __future__ import annotations

import msgspec
import pytest

from swectl.actors.data_source import DataCursor, DataSource, split_tasks
from swectl.errors import ConfigError
from swectl.tasks.record import Task


def _tasks(n: int) -> list[Task]:
    return [Task(instance_id=f"t{i:02d}", repo="r", problem_statement="p", FAIL_TO_PASS=["x"]) for i in range(n)]


def test_each_epoch_hands_out_every_task_once_in_a_seeded_order() -> None:
    source = DataSource(_tasks(7), seed=3)
    first = [t.instance_id for t in source.next(7)]
    second = [t.instance_id for t in source.next(7)]
    assert sorted(first) == sorted(second) == [f"t{i:02d}" for i in range(7)]
    assert first != second  # a new shuffle per epoch
    again = DataSource(_tasks(7), seed=3)
    assert [t.instance_id for t in again.next(7)] == first
    assert [t.instance_id for t in DataSource(_tasks(7), seed=4).next(7)] != first


def test_a_cursor_restored_from_json_continues_exactly() -> None:
    whole = DataSource(_tasks(5), seed=0)
    expected = [t.instance_id for t in whole.next(13)]
    part = DataSource(_tasks(5), seed=0)
    got = [t.instance_id for t in part.next(6)]
    saved = msgspec.json.encode(part.cursor)
    resumed = DataSource(_tasks(5), seed=0, cursor=msgspec.json.decode(saved, type=DataCursor))
    got += [t.instance_id for t in resumed.next(7)]
    assert got == expected
    assert resumed.cursor.consumed == expected
    assert resumed.statistics().epoch == 2


def test_a_task_marked_to_pass_over_is_skipped_once_and_the_mark_survives_a_resume() -> None:
    plain = [t.instance_id for t in DataSource(_tasks(5), seed=0).next(10)]
    source = DataSource(_tasks(5), seed=0)
    got = [t.instance_id for t in source.next(2)]
    source.pass_over(plain[3])
    source.pass_over(plain[3])  # marked twice: still passed over once
    saved = msgspec.json.encode(source.cursor)
    resumed = DataSource(_tasks(5), seed=0, cursor=msgspec.json.decode(saved, type=DataCursor))
    got += [t.instance_id for t in resumed.next(7)]
    assert got == [*plain[:3], plain[4], *plain[5:10]]  # the mark went with its one pass; epoch 2 has it again
    assert resumed.cursor.pass_over == [] and plain[3] not in resumed.cursor.consumed[:4]


def test_task_file_order_does_not_change_the_order() -> None:
    tasks = _tasks(6)
    a = [t.instance_id for t in DataSource(tasks, seed=1).next(6)]
    b = [t.instance_id for t in DataSource(list(reversed(tasks)), seed=1).next(6)]
    assert a == b


def test_split_is_seeded_disjoint_and_keeps_both_sides_non_empty() -> None:
    train, test = split_tasks(_tasks(10), 0.5, seed=0)
    assert len(train) == len(test) == 5
    assert not {t.instance_id for t in train} & {t.instance_id for t in test}
    assert split_tasks(_tasks(10), 0.5, seed=0) == (train, test)
    assert split_tasks(_tasks(10), 0.5, seed=1) != (train, test)
    train, test = split_tasks(_tasks(3), 0.01, seed=0)
    assert len(test) == 1 and len(train) == 2
    train, test = split_tasks(_tasks(3), 0.0, seed=0)
    assert len(test) == 0


def test_an_empty_training_split_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="test_fraction"):
        DataSource([], seed=0)
