"""Which task an instance id of a serve request names: the id itself, or ``<task id>__<suffix>`` (OpenClaw-RL's
swe-rl client allocates its grading sandbox as ``<id>__eval``); task ids hold ``__`` themselves."""

from __future__ import annotations

from swectl.serve.fleet import task_of
from swectl.tasks.record import Task


def _tasks(*ids: str) -> dict[str, Task]:
    return {i: Task(instance_id=i, repo="r/r", problem_statement="p", FAIL_TO_PASS=["t"]) for i in ids}


def test_the_id_itself_and_suffixed_ids_name_the_task() -> None:
    tasks = _tasks("django__django-11099", "astropy__astropy-12907")
    assert task_of("django__django-11099", tasks) == (tasks["django__django-11099"], "")
    assert task_of("django__django-11099__eval", tasks) == (tasks["django__django-11099"], "eval")
    assert task_of("django__django-11099__g3__i1", tasks) == (tasks["django__django-11099"], "g3__i1")


def test_the_longest_known_prefix_wins() -> None:
    tasks = _tasks("a__b", "a__b__c")
    assert task_of("a__b__c__eval", tasks) == (tasks["a__b__c"], "eval")
    assert task_of("a__b__x", tasks) == (tasks["a__b"], "x")


def test_ids_no_task_set_knows() -> None:
    tasks = _tasks("django__django-11099")
    for unknown in ("", "django", "django__django-1109__eval", "__eval", "flask__flask-1__eval",
                    "django__django-11099x__eval"):
        assert task_of(unknown, tasks) == (None, ""), unknown
