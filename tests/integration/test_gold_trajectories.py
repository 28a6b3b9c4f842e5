"""`swectl data gold` on two bundled tasks: gold scripts played through the real Rollout actor in podman
sandboxes resolve, and their traj.json files become TrainSamples whose mask-1 tokens are exactly the scripted
replies (each with its end-of-turn token); a wrong "gold" fix is reported and set aside."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the cpu extra (pip install 'swectl[cpu]')")

from transformers import AutoTokenizer

from swectl.agent.gold import gold_replies
from swectl.agent.scripted import end_of_turn_id
from swectl.cli.main import main
from swectl.data.trajectories import samples_from_runs
from swectl.images.project import BUNDLED_TASKS
from swectl.rl.batch import unpack_mask, unpack_tokens
from swectl.tasks.sources import load_tasks

pytestmark = [pytest.mark.integration]


def test_gold_trajectories_resolve_and_train_on_exactly_the_script(model: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gold"
    # two tasks of different projects and edit kinds (a sed substitution and a sed insert), and a copy of the
    # second whose "gold" fix is wrong: it runs, does not resolve, and is reported and set aside
    tasks = {t.instance_id: t for t in load_tasks(BUNDLED_TASKS).tasks}
    ids = ["cachetools__cachetools-5.5.0.796cd699", "inflection__inflection-0.5.1.0af49555"]
    rows = {json.loads(line)["instance_id"]: json.loads(line) for line in BUNDLED_TASKS.read_text().splitlines()}
    wrong = {**rows[ids[1]], "instance_id": ids[1] + "-wrong", "patch": rows[ids[1]]["patch"].replace('"rd"', '"rx"')}
    task_file = tmp_path / "tasks.jsonl"
    task_file.write_text("".join(json.dumps(r) + "\n" for r in (rows[ids[0]], rows[ids[1]], wrong)))
    assert main(["data", "gold", "--model", str(model), "--tasks", str(task_file), "--concurrency", "2",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total"] == summary["scripted"] == 3 and summary["resolved"] == 2, summary["excluded"]
    [excluded] = summary["excluded"]
    assert excluded["instance_id"] == wrong["instance_id"] and excluded["stage"] == "grade"
    assert "unresolved" in excluded["reason"] and "FAIL_TO_PASS tests fail" in excluded["reason"]
    assert summary["tokens"]["count"] == 2
    assert (out / "excluded" / f"{wrong['instance_id']}__0" / "traj.json").is_file()
    captured = capsys.readouterr()
    assert json.loads(captured.out)["resolved"] == 2
    assert f"excluded {wrong['instance_id']} (grade): unresolved" in captured.err
    results = {json.loads(line)["instance_id"]: json.loads(line) for line in
               (out / "results.jsonl").read_text().splitlines()}
    assert sorted(results) == sorted([*ids, wrong["instance_id"]])
    assert all(results[i]["resolved"] and results[i]["exit_status"] == "Submitted" for i in ids)
    assert results[wrong["instance_id"]]["artifacts"].endswith(f"excluded/{wrong['instance_id']}__0")

    tokenizer = AutoTokenizer.from_pretrained(model)
    eot = end_of_turn_id(tokenizer)
    samples = samples_from_runs([out], resolved_only=True)
    assert sorted(s.uid for s in samples) == sorted(f"{i}#0" for i in ids)
    assert samples_from_runs([out]) == samples  # the run folder holds only what to learn from
    for sample in samples:
        replies = gold_replies(tasks[sample.group])
        expected = [t for r in replies for t in [*tokenizer.encode(r, add_special_tokens=False), eot]]
        tokens, mask = unpack_tokens(sample), unpack_mask(sample)
        assert tokens[mask == 1].tolist() == expected
        assert sample.advantage == 1.0 and sample.reward == 1.0 and not sample.truncated
        episode = json.loads((out / f"{sample.group}__0" / "traj.json").read_text())["episode"]
        assert episode["trajectory"]["weight_versions"] == ["gold"] * len(replies)
        assert [s["action"] for s in episode["steps"]][-1].startswith("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
        observations = [m["content"] for m in episode["trajectory"]["messages"][3::2]]
        # real sandbox output: the failing tests pass (pytest -qq prints its progress line, no run time)
        assert "<returncode>0</returncode>" in observations[0]
        assert "<returncode>0</returncode>" in observations[-1] and "[100%]" in observations[-1]
    # a rerun into the same folder is refused rather than mixed in
    assert main(["data", "gold", "--model", str(model), "--instances", ids[0], "--out", str(out)]) == 2
    assert "holds an earlier run" in capsys.readouterr().err


def test_gold_trajectories_are_the_same_tokens_run_after_run(model: Path, tmp_path: Path) -> None:
    """Two `data gold` runs of one task give the same trajectory token for token: no run time or other clock
    reading reaches an observation (pytest's "1 passed in 0.10s" once made each first run's SFT data differ)."""
    task_id = "cachetools__cachetools-5.5.0.796cd699"
    tokens = []
    for n in range(2):
        out = tmp_path / f"gold{n}"
        assert main(["data", "gold", "--model", str(model), "--tasks", str(BUNDLED_TASKS), "--instances", task_id,
                     "--out", str(out)]) == 0
        episode = json.loads((out / f"{task_id}__0" / "traj.json").read_text())["episode"]
        tokens.append(episode["trajectory"]["token_ids"])
    assert tokens[0] == tokens[1]


def test_give_up_trajectories_look_then_submit_nothing_and_are_kept_unresolved(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "give-up"
    task_id = "inflection__inflection-0.5.1.0af49555"
    assert main(["data", "gold", "--script", "give-up", "--model", str(model), "--instances", task_id,
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["script"] == "give-up" and summary["kept"] == 1 and summary["resolved"] == 0
    assert summary["excluded"] == []
    assert "1 of 1 give-up trajectories kept" in capsys.readouterr().err
    [result] = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert result["exit_status"] == "Submitted" and not result["resolved"]
    assert result["grade"]["status"] == "unresolved" and result["grade"]["f2p_failed"]  # the real tests ran
    # rejection-sampling SFT skips it; sft_resolved_only = false trains on it, with the unresolved reward
    assert samples_from_runs([out], resolved_only=True) == []
    [sample] = samples_from_runs([out])
    assert sample.reward == 0.0
    episode = json.loads((out / f"{task_id}__0" / "traj.json").read_text())["episode"]
    assert [s["action"].split()[0] for s in episode["steps"]] == ["nl", "echo"]
    assert episode["patch"] == ""


def test_recover_trajectories_slip_twice_recover_and_train_on_the_recoveries(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "recover"
    task_id = "inflection__inflection-0.5.1.0af49555"
    assert main(["data", "gold", "--script", "recover", "--model", str(model), "--instances", task_id,
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["script"] == "recover" and summary["kept"] == 1 and summary["resolved"] == 1
    episode = json.loads((out / f"{task_id}__0" / "traj.json").read_text())["episode"]
    assert [s["format_error"] for s in episode["steps"]][:4] == [True, False, True, False]
    observations = [m["content"] for m in episode["trajectory"]["messages"][3::2]]
    assert "EXACTLY ONE bash code block" in observations[0] and "EXACTLY ONE" in observations[2]
    # SFT trains on exactly the gold replies: the two malformed ones are in the tokens but carry no loss
    tokenizer = AutoTokenizer.from_pretrained(model)
    eot = end_of_turn_id(tokenizer)
    [task] = [t for t in load_tasks(BUNDLED_TASKS).tasks if t.instance_id == task_id]
    expected = [t for r in gold_replies(task) for t in [*tokenizer.encode(r, add_special_tokens=False), eot]]
    [sample] = samples_from_runs([out], resolved_only=True)
    tokens, mask = unpack_tokens(sample), unpack_mask(sample)
    assert tokens[mask == 1].tolist() == expected
    assert len(tokens) > len(expected) + 100


def test_several_scripts_at_once_share_one_grader_that_grades_the_gold_patch_once(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The first run's SFT data: gold, give-up and recover in one process, each into --out/SCRIPT. recover ends with
    the gold patch: one of the two gradings runs, the other reuses its verdict; give-up's empty patch is unresolved
    without a run. Each folder holds what a run of its script alone holds."""
    task_id = "inflection__inflection-0.5.1.0af49555"
    assert main(["data", "gold", "--script", "gold", "--script", "give-up", "--script", "recover", "--model",
                 str(model), "--instances", task_id, "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    grades = {}
    for script, resolved in (("gold", 1), ("give-up", 0), ("recover", 1)):
        summary = json.loads((tmp_path / script / "summary.json").read_text())
        assert summary["script"] == script and summary["kept"] == 1 and summary["resolved"] == resolved
        assert f"1 of 1 {script} trajectories kept" in err
        [result] = [json.loads(line) for line in (tmp_path / script / "results.jsonl").read_text().splitlines()]
        grades[script] = result["grade"]
        assert (tmp_path / script / f"{task_id}__0" / "traj.json").is_file()
        assert (tmp_path / script / "swectl.log").is_file()
    assert grades["give-up"]["status"] == "unresolved" and grades["give-up"]["shortcut"] == "empty patch"
    shortcuts = sorted(grades[script]["shortcut"] for script in ("gold", "recover"))
    assert shortcuts[0] == "" and shortcuts[1].startswith("same patch as"), shortcuts
    ran = grades["gold"] if not grades["gold"]["shortcut"] else grades["recover"]
    assert ran["status"] == "resolved" and Path(ran["log_path"]).parent == tmp_path / "grade-logs"
    assert len(samples_from_runs([tmp_path / "gold", tmp_path / "give-up", tmp_path / "recover"])) == 3
    # one of them already made: a rerun is refused rather than mixed in
    assert main(["data", "gold", "--script", "gold", "--script", "recover", "--model", str(model), "--instances",
                 task_id, "--out", str(tmp_path)]) == 2
    assert "holds an earlier run" in capsys.readouterr().err


def test_gold_under_managed_context_trains_each_step_on_the_prompt_the_engine_saw(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With rollout.manage_context the gold episode records each step's prompt (head + tail once the history
    outgrows the context): SFT gets one sample per step, still counted as one kept trajectory, and the mask-1
    tokens of the steps are exactly the scripted replies."""
    out = tmp_path / "gold-ctx"
    task_id = "inflection__inflection-0.5.1.0af49555"
    assert main(["data", "gold", "--model", str(model), "--instances", task_id, "--out", str(out),
                 "--set", "rollout.context=1536", "--set", "rollout.max_tokens=256",
                 "--set", "rollout.manage_context=true"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kept"] == summary["resolved"] == 1
    assert "1 of 1 gold trajectories kept" in capsys.readouterr().err
    episode = json.loads((out / f"{task_id}__0" / "traj.json").read_text())["episode"]
    steps = episode["samples"]
    assert len(steps) == len(episode["steps"]) == summary["tokens"]["count"] > 1
    assert steps[0]["omitted_turns"] == 0 and steps[-1]["omitted_turns"] > 0  # the last prompt left turns out
    assert all(len(s["prompt_ids"]) + 256 <= 1536 for s in steps)
    samples = samples_from_runs([out], resolved_only=True)
    assert [s.uid for s in samples] == [f"{task_id}#0.{s['step']}" for s in steps]
    tokenizer = AutoTokenizer.from_pretrained(model)
    eot = end_of_turn_id(tokenizer)
    [task] = [t for t in load_tasks(BUNDLED_TASKS).tasks if t.instance_id == task_id]
    expected = [t for r in gold_replies(task) for t in [*tokenizer.encode(r, add_special_tokens=False), eot]]
    trained = [t for s in samples for t in unpack_tokens(s)[unpack_mask(s) == 1].tolist()]
    assert trained == expected
