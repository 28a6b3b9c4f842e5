"""Judge training data (swectl/data/judge.py, `swectl data judge`): which steps get which label, the step views
rebuilt from a recorded episode, the JSONL rows, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from swectl.agent.loop import Episode, Step
from swectl.agent.protocol import SUBMIT_SENTINEL
from swectl.agent.trajectory import Message, Trajectory
from swectl.data.judge import BAD, GOOD, judge_examples, step_labels, step_views, write_judge_data
from swectl.errors import TaskDataError
from swectl.rl.prm import JUDGE_SYSTEM, parse_vote

REPO = Path(__file__).resolve().parent.parent
LOOK = "THOUGHT: look.\n\n```bash\ncat a.py\n```"
SLIP = "THOUGHT: edit it with `sed"
SUBMIT = f"THOUGHT: done.\n\n```bash\necho {SUBMIT_SENTINEL} && git diff\n```"


def episode(*, submitted: str = "", exit_status: str = "Submitted", instance_id: str = "t-1") -> Episode:
    """Three steps: a look, a malformed reply, a submission (its output is not in the messages: it ended the run)."""
    messages = [Message("system", "sys"), Message("user", "the problem"), Message("assistant", LOOK),
                Message("user", "<output>x = 1</output>"), Message("assistant", SLIP),
                Message("user", "Please give exactly one bash block."), Message("assistant", SUBMIT)]
    return Episode(instance_id=instance_id, exit_status=exit_status,
                   outcome="COMPLETED" if exit_status == "Submitted" else "TRUNCATED", submitted=submitted,
                   steps=[Step(step=0, action="cat a.py"), Step(step=1, format_error=True),
                          Step(step=2, action="echo ...")],
                   trajectory=Trajectory(messages=messages))


def test_labels_follow_the_outcome_rules() -> None:
    resolved = step_labels(episode(submitted="diff"), resolved=True)
    assert resolved == {0: (GOOD, "resolved"), 1: (BAD, "malformed"), 2: (GOOD, "resolved")}
    unresolved = step_labels(episode(submitted=""), resolved=False)
    assert unresolved == {1: (BAD, "malformed"), 2: (BAD, "submission")}  # the first look is left unlabelled
    ran_out = step_labels(episode(exit_status="LimitsExceeded"), resolved=False)
    assert ran_out == {1: (BAD, "malformed")}  # no submission to blame


def test_step_views_rebuild_what_the_judge_saw() -> None:
    views = step_views(episode(submitted="diff --git a/a.py b/a.py\n"))
    assert [(v.step, v.reply) for v in views] == [(0, LOOK), (1, SLIP), (2, SUBMIT)]
    assert views[0].observation == "<output>x = 1</output>"
    assert views[1].observation == "Please give exactly one bash block."
    assert views[2].observation == f"{SUBMIT_SENTINEL}\ndiff --git a/a.py b/a.py\n"  # the submit command's output
    # an episode that ended on its last reply without recording what came back: that step cannot be rebuilt
    assert [v.step for v in step_views(episode(exit_status="FormatError"))] == [0, 1]


def write_run(folder: Path, ep: Episode, resolved: bool, sample: int = 0) -> None:
    out = folder / f"{ep.instance_id}__{sample}"
    out.mkdir(parents=True)
    (out / "traj.json").write_bytes(msgspec.json.encode({"format_version": 1, "episode": ep}))
    (out / "meta.json").write_text(json.dumps({"instance_id": ep.instance_id, "sample": sample,
                                               "resolved": resolved}))


def test_examples_rows_and_summary(tmp_path: Path) -> None:
    write_run(tmp_path / "run", episode(submitted="diff"), resolved=True, sample=0)
    write_run(tmp_path / "run", episode(submitted=""), resolved=False, sample=1)
    write_run(tmp_path / "run", episode(instance_id="unknown"), resolved=True, sample=0)
    examples, summary = judge_examples([tmp_path / "run"], {"t-1": "The issue text"}, history_steps=1)
    assert (summary.episodes, summary.resolved_episodes, summary.steps) == (2, 1, 6)
    assert (summary.good, summary.bad_malformed, summary.bad_submission, summary.unlabelled) == (2, 2, 1, 1)
    assert len(summary.skipped_episodes) == 1 and "unknown is not in the task set" in summary.skipped_episodes[0]
    last = next(e for e in examples if e.sample == 1 and e.step == 2)
    system, user = last.messages
    assert system == {"role": "system", "content": JUDGE_SYSTEM}
    assert user["content"].startswith("The issue:\nThe issue text")
    assert "(1 earlier steps left out)" in user["content"] and SLIP in user["content"]  # history_steps=1
    write_judge_data(examples, tmp_path / "judge.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "judge.jsonl").read_text().splitlines()]
    assert len(rows) == len(examples) == 5
    assert all(parse_vote(r["messages"][-1]["content"]) == r["label"] for r in rows)
    assert not list(tmp_path.glob("*.partial"))


def test_rows_train_as_sft_data(tmp_path: Path, tiny_tokenizer) -> None:
    """The rows are OpenAI-messages JSONL that train.data.sft_data reads: only the verdict is trained."""
    from swectl.data.trajectories import samples_from_messages_jsonl
    from swectl.rl.batch import unpack_mask, unpack_tokens

    write_run(tmp_path / "run", episode(submitted=""), resolved=False)
    examples, _ = judge_examples([tmp_path / "run"], {"t-1": "The issue text"})
    write_judge_data(examples, tmp_path / "judge.jsonl")
    samples = samples_from_messages_jsonl(tmp_path / "judge.jsonl", tiny_tokenizer, strict=True)
    assert len(samples) == 2
    for sample in samples:
        trained = [int(t) for t, m in zip(unpack_tokens(sample), unpack_mask(sample), strict=True) if m]
        assert tiny_tokenizer.decode(trained, skip_special_tokens=True).strip() == "\\boxed{-1}"


def test_nothing_to_label_is_an_error(tmp_path: Path) -> None:
    one_look = msgspec.structs.replace(episode(exit_status="LimitsExceeded"), steps=[Step(step=0, action="cat a.py")])
    write_run(tmp_path / "run", one_look, resolved=False)
    examples, summary = judge_examples([tmp_path / "run"], {"t-1": "x"})
    assert examples == [] and summary.unlabelled == 1
    with pytest.raises(TaskDataError, match="no labelled step"):
        write_judge_data(examples, tmp_path / "judge.jsonl")
    assert not (tmp_path / "judge.jsonl").exists()


def test_cli_refuses_the_evaluation_set(tmp_path: Path) -> None:
    write_run(tmp_path / "run", episode(submitted="diff"), resolved=True)
    verified = tmp_path / "swe_bench_verified.jsonl"
    verified.write_text("")
    done = subprocess.run([sys.executable, "-m", "swectl.cli.main", "data", "judge", str(tmp_path / "run"),
                           "--tasks", str(verified), "--out", str(tmp_path / "j.jsonl")],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert "evaluation set" in done.stderr and not (tmp_path / "j.jsonl").exists()
