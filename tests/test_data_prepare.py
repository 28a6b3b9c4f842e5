"""swectl.cli.data: the prompt file format, images.txt, problems.jsonl, the CLI and the eval-set guard."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from swectl.cli.main import main
from swectl.data.prepare import EvalSetError, check_not_eval_set, is_eval_set, prepare
from swectl.images.names import ImageResolver
from swectl.tasks.record import Task
from swectl.tasks.sources import RowProblem


def _task(instance_id: str, **fields: Any) -> Task:
    defaults: dict[str, Any] = {
        "repo": "getmoto/moto",
        "problem_statement": f"problem of {instance_id}",
        "FAIL_TO_PASS": ["tests/test_a.py::test_a"],
    }
    return Task(instance_id=instance_id, **{**defaults, **fields})


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _row(instance_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "repo": "getmoto/moto",
        "problem_statement": f"problem of {instance_id} ✓",
        "FAIL_TO_PASS": ["tests/test_a.py::test_a"],
        "PASS_TO_PASS": [],
        "version": "4.1",
        **fields,
    }


def test_prepare_writes_prompts_images_and_problems(tmp_path: Path) -> None:
    tasks = [
        _task("getmoto__moto-2", source="swe-gym", extra={"difficulty": "easy"}),
        _task("getmoto__moto-1", source="swe-gym"),
        _task("synth__x-1", image="localhost/shared:1"),
        _task("synth__x-2", image="localhost/shared:1"),
    ]
    problem = RowProblem("tasks.jsonl:3", "FAIL_TO_PASS", "expected a list of test names, got int 3")
    summary = prepare(tasks, tmp_path / "out", data_source="swe-gym", resolver=ImageResolver(), problems=[problem])

    prompts = _read_jsonl(tmp_path / "out" / "prompts.jsonl")
    assert len(prompts) == summary.prompts == 4
    first = prompts[0]
    assert set(first) == {"text", "prompt", "label", "metadata"}
    assert first["text"] == first["prompt"] == "problem of getmoto__moto-2"
    assert first["label"] == first["metadata"]["instance_id"] == "getmoto__moto-2"
    assert first["metadata"]["data_source"] == "swe-gym"
    official = "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-2:latest"
    expected_instance = {**tasks[0].row(), "image": official, "image_name": official}
    assert first["metadata"]["instance"] == expected_instance
    assert (first["metadata"]["image"], first["metadata"]["workdir"]) == (official, "/testbed")
    assert first["metadata"]["instance"]["difficulty"] == "easy"
    assert isinstance(first["metadata"]["instance"]["FAIL_TO_PASS"], list)

    images = (tmp_path / "out" / "images.txt").read_text().splitlines()
    assert images == [
        "localhost/shared:1",
        "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-1:latest",
        "xingyaoww/sweb.eval.x86_64.getmoto_s_moto-2:latest",
    ]
    assert summary.images == 3
    assert [RowProblem(**p) for p in _read_jsonl(tmp_path / "out" / "problems.jsonl")] == [problem]
    assert summary.problems_path.endswith("problems.jsonl")

    # A clean rerun removes the stale problem list.
    again = prepare(tasks, tmp_path / "out", data_source="swe-gym")
    assert not (tmp_path / "out" / "problems.jsonl").exists()
    assert again.problems_path == ""


def test_prepare_uses_the_resolver_for_instance_and_images(tmp_path: Path) -> None:
    tasks = [_task("a__b-1"), _task("a__b-2")]
    prepare(tasks, tmp_path, data_source="x", resolver=ImageResolver(template="mirror.local/{official}"))
    prompts = _read_jsonl(tmp_path / "prompts.jsonl")
    assert prompts[1]["metadata"]["instance"]["image"] == "mirror.local/swebench/sweb.eval.x86_64.a_1776_b-2:latest"
    assert (tmp_path / "images.txt").read_text() == (
        "mirror.local/swebench/sweb.eval.x86_64.a_1776_b-1:latest\n"
        "mirror.local/swebench/sweb.eval.x86_64.a_1776_b-2:latest\n"
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("../shared/data/swe_bench_verified.jsonl", True),
        ("princeton-nlp/SWE-bench_Verified", True),
        ("SWE-bench/SWE-bench_Verified:test", True),
        ("data/SWE-Bench-Verified-mini.parquet", True),
        ("swebench_verified.json", True),
        ("SWE-Gym/SWE-Gym", False),
        ("princeton-nlp/SWE-bench", False),
        ("verified_smith_tasks.jsonl", False),
    ],
)
def test_is_eval_set(name: str, expected: bool) -> None:
    assert is_eval_set(name) is expected


def test_eval_set_guard_follows_links_and_data_source(tmp_path: Path) -> None:
    real = tmp_path / "swe_bench_verified.jsonl"
    real.write_text("")
    link = tmp_path / "train.jsonl"
    link.symlink_to(real)
    with pytest.raises(EvalSetError, match="evaluation set"):
        check_not_eval_set(str(link))
    with pytest.raises(EvalSetError):
        check_not_eval_set("mine.jsonl", "SWE-bench_Verified")
    check_not_eval_set(str(link), allow=True)
    check_not_eval_set(str(tmp_path / "plain.jsonl"), "swe-gym")


# ------------------------------------------------------------------------------------------------------ CLI


def _run(argv: list[str]) -> int:
    """``swectl data prepare ARGV`` through the CLI's one exit-code mapping."""
    return main(["data", "prepare", *argv])


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def test_cli_prepare_reports_rows_kept_and_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows: list[Any] = [_row(f"getmoto__moto-{i}") for i in range(3)]
    rows += ["{not json", _row("getmoto__moto-0"), _row("getmoto__moto-9", FAIL_TO_PASS="x")]
    rows += [_row(f"bad__{i}", FAIL_TO_PASS=[]) for i in range(5)]
    source = _jsonl(tmp_path / "gym.jsonl", rows)
    assert _run([str(source), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"read 11 rows from {source}: 3 tasks kept, 8 problems" in out
    assert f"  {source}:4: (row): not valid JSON" in out
    assert f"  {source}:5: instance_id: duplicate instance_id 'getmoto__moto-0'" in out
    assert "... and 3 more" in out
    assert "data_source 'swe-gym'" in out  # the tasks' common source
    prompts = _read_jsonl(tmp_path / "out" / "prompts.jsonl")
    assert [p["metadata"]["instance"]["instance_id"] for p in prompts] == [f"getmoto__moto-{i}" for i in range(3)]
    assert prompts[0]["text"] == "problem of getmoto__moto-0 ✓"
    assert len(_read_jsonl(tmp_path / "out" / "problems.jsonl")) == 8


def test_cli_strict_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _jsonl(tmp_path / "t.jsonl", [_row("a__b-1"), _row("a__b-2", FAIL_TO_PASS=5)])
    assert _run([str(source), "--out", str(tmp_path / "out"), "--strict"]) == 2
    err = capsys.readouterr().err
    assert f"{source}:2: FAIL_TO_PASS: expected a list of test names, got int 5" in err
    assert not (tmp_path / "out").exists()


def test_cli_options_hint_template_and_data_source(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "t.jsonl", [_row("Octo__Demo-1", repo="octo/demo")])
    out = tmp_path / "out"
    assert _run([str(source), "--out", str(out), "--source-hint", "swe-gym", "--data-source", "gym-train"]) == 0
    prompt = _read_jsonl(out / "prompts.jsonl")[0]
    assert prompt["metadata"]["data_source"] == "gym-train"
    assert prompt["metadata"]["instance"]["source"] == "swe-gym"
    assert (out / "images.txt").read_text() == "xingyaoww/sweb.eval.x86_64.octo_s_demo-1:latest\n"
    assert _run([str(source), "--out", str(out), "--image-template", "r/{id_docker}:{version}"]) == 0
    assert (out / "images.txt").read_text() == "r/octo_1776_demo-1:4.1\n"


def test_cli_bad_template_and_exclusive_image_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _jsonl(tmp_path / "t.jsonl", [_row("a__b-1")])
    assert _run([str(source), "--out", str(tmp_path / "o"), "--image-template", "x/{iid}"]) == 2
    assert "unknown placeholder {iid}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _run([str(source), "--out", str(tmp_path / "o"), "--image-template", "x", "--image-map", "m.json"])


def test_cli_nothing_loaded_exits_1(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "t.jsonl", [_row("a__b-1", FAIL_TO_PASS=[])])
    assert _run([str(source), "--out", str(tmp_path / "o")]) == 1


def test_cli_refuses_swe_bench_verified(
    verified_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert _run([str(verified_path), "--out", str(out)]) == 2
    assert "SWE-bench Verified" in capsys.readouterr().err
    assert not out.exists()
    renamed = tmp_path / "SWE-bench_Verified.part.jsonl"
    shutil.copy(verified_path, renamed)
    assert _run([str(renamed), "--out", str(out)]) == 2
    assert _run(["princeton-nlp/SWE-bench_Verified", "--out", str(out)]) == 2  # refused before any network use
    assert not out.exists()
    assert _run([str(verified_path), "--out", str(out), "--allow-eval-set"]) == 0
    assert len((out / "prompts.jsonl").read_text().splitlines()) == 500
    assert len((out / "images.txt").read_text().splitlines()) == 500


def test_rows_give_openclaw_rl_swe_rl_the_image_it_runs(tmp_path: Path) -> None:
    """What OpenClaw-RL's swe-rl rollout reads of a row (seen running its code): ``metadata.instance`` with
    ``instance_id``, ``problem_statement`` and ``eval_script`` (may be absent), and the image: ``image_name``
    verbatim when the key is there, else a Docker Hub name derived only for a data_source naming swe-gym or
    swe-bench (anything else raised NotImplementedError: our synthesised rows crashed it)."""
    tasks = [_task("synth__x-1", image="localhost/swectl-proj.x:1", source="swectl-synth")]
    prepare(tasks, tmp_path, data_source="swectl-synth", resolver=ImageResolver())
    row = _read_jsonl(tmp_path / "prompts.jsonl")[0]
    instance = row["metadata"]["instance"]
    assert instance["image_name"] == "localhost/swectl-proj.x:1"  # no derivation from "swectl-synth" needed
    assert instance["instance_id"] == "synth__x-1" and instance["problem_statement"] == "problem of synth__x-1"
