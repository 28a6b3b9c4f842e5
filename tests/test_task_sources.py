"""swectl.tasks.sources: file formats, row styles, problems with locations, strict mode, the Hub path."""

from __future__ import annotations

import datetime as dt
import gzip
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from swectl.errors import TaskDataError
from swectl.tasks import sources as task_sources
from swectl.tasks.diffs import reverse_diff
from swectl.tasks.record import Task
from swectl.tasks.sources import ROW, RowProblem, RowProblemError, detect_source, load_tasks, normalise_row

BUG = (
    "diff --git a/src/calc.py b/src/calc.py\n"
    "--- a/src/calc.py\n"
    "+++ b/src/calc.py\n"
    "@@ -1,3 +1,3 @@\n"
    " def add(a, b):\n"
    "-    return a + b\n"
    "+    return a - b\n"
    " \n"
)


def _verified_rows(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[:limit]]


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _row(instance_id: str = "octo__demo-1", **fields: Any) -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "repo": "octo/demo",
        "problem_statement": "add() is wrong",
        "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_sub"],
        **fields,
    }


# ------------------------------------------------------------------------------------------ SWE-bench Verified


def test_all_verified_rows_load(verified_path: Path) -> None:
    result = load_tasks(verified_path)
    assert (len(result.tasks), result.problems, result.rows_read) == (500, [], 500)
    assert all(isinstance(t.FAIL_TO_PASS, list) for t in result.tasks)
    assert [t.instance_id for t in result.tasks if not t.FAIL_TO_PASS] == []
    assert all(isinstance(name, str) for t in result.tasks for name in t.FAIL_TO_PASS + t.PASS_TO_PASS)
    assert {t.source for t in result.tasks} == {"swe-bench"}
    first = result.tasks[0]
    assert first.instance_id == "astropy__astropy-12907"
    assert first.environment_setup_commit
    assert first.base_commit
    assert first.patch.startswith("diff --git")
    assert first.extra == {"difficulty": "15 min - 1 hour"}
    original = _verified_rows(verified_path, 1)[0]
    assert {k: v for k, v in first.row().items() if k in original} == original  # nothing lost


def test_hugging_face_style_json_string_test_lists(verified_path: Path, tmp_path: Path) -> None:
    rows = _verified_rows(verified_path, 40)
    encoded = [
        {**r, "FAIL_TO_PASS": json.dumps(r["FAIL_TO_PASS"]), "PASS_TO_PASS": json.dumps(r["PASS_TO_PASS"])}
        for r in rows
    ]
    from_lists = load_tasks(_write_jsonl(tmp_path / "lists.jsonl", rows))
    from_strings = load_tasks(_write_jsonl(tmp_path / "strings.jsonl", encoded))
    assert from_strings.problems == []
    assert from_strings.tasks == from_lists.tasks
    assert isinstance(from_strings.tasks[0].PASS_TO_PASS, list)


def test_json_array_object_and_gzip_files(verified_path: Path, tmp_path: Path) -> None:
    rows = _verified_rows(verified_path, 5)
    expected = load_tasks(_write_jsonl(tmp_path / "a.jsonl", rows)).tasks
    array = tmp_path / "array.json"
    array.write_text(json.dumps(rows))
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"instances": rows, "note": "x"}))
    zipped = tmp_path / "rows.jsonl.gz"
    zipped.write_bytes(gzip.compress((tmp_path / "a.jsonl").read_bytes()))
    for path in (array, wrapped, zipped):
        assert load_tasks(path).tasks == expected, path


def test_parquet_file(verified_path: Path, tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = _verified_rows(verified_path, 30)
    # As on Hugging Face: test lists as JSON strings.
    hf_rows = [
        {**r, "FAIL_TO_PASS": json.dumps(r["FAIL_TO_PASS"]), "PASS_TO_PASS": json.dumps(r["PASS_TO_PASS"])}
        for r in rows
    ]
    hf_rows[7]["FAIL_TO_PASS"] = None
    path = tmp_path / "verified.parquet"
    pq.write_table(pa.Table.from_pylist(hf_rows), path)
    result = load_tasks(path)
    assert [t.instance_id for t in result.tasks] == [r["instance_id"] for i, r in enumerate(rows) if i != 7]
    assert result.problems == [RowProblem(f"{path}[7]", "FAIL_TO_PASS", "required field is null")]
    assert result.tasks[0] == load_tasks(_write_jsonl(tmp_path / "one.jsonl", rows[:1])).tasks[0]


def test_parquet_timestamp_created_at_becomes_iso_text(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    row = _row(created_at=dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.UTC))
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    assert load_tasks(path).tasks[0].created_at == "2024-05-01T12:30:00+00:00"


# ----------------------------------------------------------------------------------------------- row styles


def test_swe_gym_rows_detected_by_repo_hint_or_data_source() -> None:
    gym = _row("getmoto__moto-6041", repo="getmoto/moto", version="4.1", hints_text="")
    assert normalise_row(gym, "g:1").source == "swe-gym"
    # Same shape, SWE-bench repo: stays SWE-bench.
    assert normalise_row(_row(), "g:2").source == "swe-bench"
    # Explicit: the caller's hint, or the row's data_source.
    assert normalise_row(_row(), "g:3", source_hint="swe-gym").source == "swe-gym"
    assert normalise_row(_row(data_source="SWE-Gym/SWE-Gym"), "g:4").source == "swe-gym"
    # A SWE-Gym repository in a row that has SWE-bench's environment_setup_commit is SWE-bench style.
    with_env = {**gym, "environment_setup_commit": "abc"}
    assert normalise_row(with_env, "g:5").source == "swe-bench"


def test_swe_gym_file_with_source_hint(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "gym.jsonl", [_row("a__b-1"), _row("a__b-2")])
    result = load_tasks(path, source_hint="swe-gym")
    assert [t.source for t in result.tasks] == ["swe-gym", "swe-gym"]
    with pytest.raises(TaskDataError, match="source hint"):
        load_tasks(path, source_hint="gym")  # type: ignore[arg-type]


def _smith_row(**fields: Any) -> dict[str, Any]:
    return {
        "instance_id": "octo__demo.1a2b3c4d.func_pm_op_change__x1",
        "repo": "swesmith/octo__demo.1a2b3c4d",
        "patch": BUG,
        "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_sub"],
        "created_at": "2025-04-01T00:00:00",
        "image_name": "jyangballin/swesmith.x86_64.octo_1776_demo.1a2b3c4d",
        "base_commit": "f" * 40,
        "problem_statement": "add() subtracts",
        **fields,
    }


def test_swe_smith_patch_is_the_bug_and_is_reversed_into_the_fix() -> None:
    task = normalise_row(_smith_row(), "s:1")
    assert task.source == "swe-smith"
    assert task.setup_patch == BUG
    assert task.patch == reverse_diff(BUG)
    assert "-    return a - b\n+    return a + b\n" in task.patch
    assert task.image == "jyangballin/swesmith.x86_64.octo_1776_demo.1a2b3c4d"
    # The bug commit lives in the swesmith mirror, not in the image: kept aside, not as base_commit.
    assert task.base_commit == ""
    assert task.extra == {"bug_commit": "f" * 40}
    assert task.repo == "swesmith/octo__demo.1a2b3c4d"


def test_swe_smith_detected_without_the_mirror_prefix_and_normalising_twice_is_stable() -> None:
    row = _smith_row(repo="octo__demo.1a2b3c4d")  # image_name and no test_patch
    task = normalise_row(row, "s:1")
    assert task.source == "swe-smith"
    again = normalise_row(task.row(), "s:2")
    assert again == task  # the fix is not reversed a second time


def test_swe_smith_row_without_a_usable_patch_is_a_problem() -> None:
    with pytest.raises(RowProblemError) as empty:
        normalise_row(_smith_row(patch=""), "s:3")
    assert (empty.value.problem.field, "bug-introducing" in empty.value.problem.message) == ("patch", True)
    with pytest.raises(RowProblemError, match="cannot reverse"):
        normalise_row(_smith_row(patch="--- a/x\n+++ b/x\n@@ -1,5 +1,5 @@\n a\n"), "s:4")


def test_swe_bench_5x_rows_keep_their_environment() -> None:
    row = _row(
        image="ghcr.io/x/demo:1",
        eval_script="#!/bin/bash\npytest",
        log_parser="parse_log_pytest",
        eval_type="fail_only",
    )
    task = normalise_row(row, "b:1")
    assert (task.image, task.eval_script, task.log_parser, task.eval_type) == (
        "ghcr.io/x/demo:1",
        "#!/bin/bash\npytest",
        "parse_log_pytest",
        "fail_only",
    )
    assert task.source == "swe-bench"
    assert task.extra == {}


def test_environment_rows_missing_pieces_are_problems() -> None:
    with pytest.raises(RowProblemError) as missing:
        normalise_row(_row(image="img", eval_script="pytest"), "b:2")
    assert missing.value.problem.field == "log_parser"
    pytest.importorskip("swebench")
    with pytest.raises(RowProblemError, match=r"did you mean 'parse_log_pytest'"):
        normalise_row(_row(image="img", eval_script="pytest", log_parser="parse_log_pytset"), "b:3")
    with pytest.raises(RowProblemError, match="eval_type"):
        normalise_row(_row(eval_type="all"), "b:4")


def test_factory_rows_carry_every_field() -> None:
    task = Task(
        instance_id="synth__demo-0001",
        repo="octo/demo",
        problem_statement="p",
        FAIL_TO_PASS=["t::a"],
        patch=reverse_diff(BUG),
        setup_patch=BUG,
        image="localhost/swectl-demo:1",
        eval_script="pytest",
        log_parser="parse_log_pytest",
        source="swectl-synth",
        extra={"difficulty": 3, "created_by": "factory"},
    )
    assert normalise_row(task.row(), "f:1") == task
    with pytest.raises(RowProblemError) as no_image:
        normalise_row({**task.row(), "image": ""}, "f:2")
    message = "a swectl-synth row must carry image; it is missing or empty"
    assert no_image.value.problem == RowProblem("f:2", "image", message)


def test_unknown_fields_go_to_extra_and_empty_problem_statement_is_fine() -> None:
    task = normalise_row(_row(problem_statement="", difficulty="hard", meta={"k": [1]}), "e:1")
    assert task.problem_statement == ""
    assert task.extra == {"difficulty": "hard", "meta": {"k": [1]}}
    assert task.row()["meta"] == {"k": [1]}


def test_detect_source_prefers_the_rows_own_source() -> None:
    assert detect_source({"source": "swe-smith"}, "swe-gym") == "swe-smith"
    assert detect_source({"source": "github"}, "swe-gym") == "swe-gym"
    assert detect_source({"repo": ["not", "a", "string"]}) == "swe-bench"


# ------------------------------------------------------------------------------------------ malformed rows

MALFORMED = [
    json.dumps(_row("ok__one-1")),  # 1 good
    '{"instance_id": "broken", ',  # 2 bad JSON
    "",  # 3 blank: skipped, not a row
    json.dumps({k: v for k, v in _row("m__m-4").items() if k != "FAIL_TO_PASS"}),  # 4 missing field
    json.dumps(_row("m__m-5", FAIL_TO_PASS=3)),  # 5 wrong type
    json.dumps(_row("ok__one-1")),  # 6 duplicate of line 1
    json.dumps(["not", "an", "object"]),  # 7 not an object
    json.dumps(_row("m__m-8", PASS_TO_PASS=["ok", 7])),  # 8 wrong item type
    json.dumps(_row("m__m-9", FAIL_TO_PASS=[])),  # 9 empty list
    json.dumps(_row("m__m-10", FAIL_TO_PASS="not json")),  # 10 string that is not JSON
    json.dumps({k: v for k, v in _row("m__m-11").items() if k != "problem_statement"}),  # 11 missing
    json.dumps(_row("m__m-12", repo=None)),  # 12 null
    json.dumps(_row("m__m-13", version=3.1)),  # 13 wrong scalar type
    json.dumps(_row("ok__two-14")),  # 14 good
]


def _malformed(tmp_path: Path) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(MALFORMED) + "\n", encoding="utf-8")
    return path


def test_malformed_rows_are_reported_with_line_and_field(tmp_path: Path) -> None:
    path = _malformed(tmp_path)
    seen: list[RowProblem] = []
    result = load_tasks(path, on_problem=seen.append)
    assert [t.instance_id for t in result.tasks] == ["ok__one-1", "ok__two-14"]
    assert result.rows_read == 13
    where = [(p.location.removeprefix(str(path)), p.field) for p in result.problems]
    assert where == [
        (":2", ROW),
        (":4", "FAIL_TO_PASS"),
        (":5", "FAIL_TO_PASS"),
        (":6", "instance_id"),
        (":7", ROW),
        (":8", "PASS_TO_PASS[1]"),
        (":9", "FAIL_TO_PASS"),
        (":10", "FAIL_TO_PASS"),
        (":11", "problem_statement"),
        (":12", "repo"),
        (":13", "version"),
    ]
    assert seen == result.problems
    messages = {p.location.removeprefix(str(path)): p.message for p in result.problems}
    assert messages[":4"] == "required field is missing"
    assert messages[":5"] == "expected a list of test names, got int 3"
    assert messages[":6"] == f"duplicate instance_id 'ok__one-1' (first seen at {path}:1)"
    assert messages[":7"] == "expected an object of fields, got a list of 3 items"
    assert messages[":8"] == "expected a test name (a non-empty string), got int 7"
    assert messages[":9"] == "expected a non-empty list of test names, got an empty list"
    assert "not JSON" in messages[":10"]
    assert messages[":12"] == "required field is null"
    assert messages[":13"] == "expected a string, got float 3.1"
    assert messages[":2"].startswith("not valid JSON")


def test_strict_mode_raises_the_first_problem(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(MALFORMED[0] + "\n" + MALFORMED[4] + "\n" + MALFORMED[1] + "\n")
    with pytest.raises(RowProblemError) as raised:
        load_tasks(path, strict=True)
    message = str(raised.value)
    assert message.startswith(f"{path}:2: FAIL_TO_PASS: expected a list of test names, got int 3")
    assert "hint:" in message
    assert isinstance(raised.value, TaskDataError)
    assert raised.value.problem.location == f"{path}:2"


def test_json_array_problems_use_the_index(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([_row("a__a-1"), {**_row(), "instance_id": ""}, _row("a__a-1")]))
    result = load_tasks(path)
    assert [(p.location, p.field) for p in result.problems] == [
        (f"{path}[1]", "instance_id"),
        (f"{path}[2]", "instance_id"),
    ]


def test_whole_file_errors_raise(tmp_path: Path) -> None:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[\n  {"instance_id": "x"},\n  oops\n]')
    with pytest.raises(TaskDataError, match=r"bad\.json:3: not valid JSON"):
        load_tasks(bad_json)
    scalar = tmp_path / "scalar.json"
    scalar.write_text("42")
    with pytest.raises(TaskDataError, match="expected a JSON array of rows"):
        load_tasks(scalar)
    with pytest.raises(TaskDataError, match="no such file"):
        load_tasks(tmp_path / "missing.jsonl")
    odd = tmp_path / "rows.csv"
    odd.write_text("a,b\n")
    with pytest.raises(TaskDataError, match="unknown file type"):
        load_tasks(odd)
    with pytest.raises(TaskDataError, match="is a directory"):
        load_tasks(tmp_path)


# ------------------------------------------------------------------------------------------ Hugging Face names


@pytest.fixture
def no_network_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_unreachable_hub_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, no_network_env: None) -> None:
    datasets = pytest.importorskip("datasets")
    probed: list[tuple[str, int]] = []
    monkeypatch.setattr(task_sources, "_hub_reachable", lambda host, port: probed.append((host, port)) or False)

    def must_not_be_called(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("load_dataset called although the hub is unreachable")

    monkeypatch.setattr(datasets, "load_dataset", must_not_be_called)
    with pytest.raises(TaskDataError) as raised:
        load_tasks("SWE-Gym/SWE-Gym", split="train")
    assert "could not reach the Hugging Face Hub" in str(raised.value)
    assert "local file" in str(raised.value)
    assert probed == [("huggingface.co", 443)]


def test_hub_dataset_rows_load_with_split_from_the_name(monkeypatch: pytest.MonkeyPatch, no_network_env: None) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(task_sources, "_hub_reachable", lambda host, port: True)
    calls: list[tuple[str, str]] = []
    rows = [
        _row("getmoto__moto-1", repo="getmoto/moto", FAIL_TO_PASS='["t::a"]', PASS_TO_PASS="[]"),
        _row("getmoto__moto-2", repo="getmoto/moto", FAIL_TO_PASS="[]"),
    ]

    def fake_load_dataset(name: str, split: str) -> list[dict[str, Any]]:
        calls.append((name, split))
        return rows

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    result = load_tasks("SWE-Gym/SWE-Gym:train", split="test")
    assert calls == [("SWE-Gym/SWE-Gym", "train")]
    assert [(t.instance_id, t.source, t.FAIL_TO_PASS, t.PASS_TO_PASS) for t in result.tasks] == [
        ("getmoto__moto-1", "swe-gym", ["t::a"], [])
    ]
    assert [(p.location, p.field) for p in result.problems] == [("SWE-Gym/SWE-Gym:train[1]", "FAIL_TO_PASS")]


def test_hub_load_failure_is_a_task_data_error(monkeypatch: pytest.MonkeyPatch, no_network_env: None) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(task_sources, "_hub_reachable", lambda host, port: True)

    def unknown_split(name: str, split: str) -> None:
        raise ValueError(f"Unknown split \"{split}\". Should be one of ['train'].")

    monkeypatch.setattr(datasets, "load_dataset", unknown_split)
    with pytest.raises(TaskDataError, match=r"no split 'test'.*\n  hint: name the split"):
        load_tasks("SWE-Gym/SWE-Gym")


def test_hub_probe_is_bounded() -> None:
    # A port nothing listens on, on the local host: refused at once, well inside the bound.
    assert task_sources._hub_reachable("127.0.0.1", 9, timeout=2.0) is False


def test_load_result_is_a_msgspec_struct(tmp_path: Path) -> None:
    result = load_tasks(_malformed(tmp_path))
    decoded = msgspec.json.decode(msgspec.json.encode(result), type=task_sources.LoadResult)
    assert decoded == result
