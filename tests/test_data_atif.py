"""ATIF out and in (swectl/data/atif.py): swectl's episodes written as ATIF-v1.7 and checked by Harbor's own
validator; ATIF written by Harbor's own models read back as SFT samples (copied context never trained) and shown by
`swectl view`. Episodes are made by the real agent loop with a scripted engine and written by the Rollout actor's own
artifact writer (tests/test_data_trajectories.py), so the files are exactly those of a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swectl.agent.loop import EpisodeConfig
from swectl.cli.main import main
from swectl.data.atif import SCHEMA_VERSION, atif_files, export_runs, read_atif, samples_from_atif
from swectl.data.trajectories import samples_from_runs
from swectl.errors import TaskDataError
from swectl.rl.batch import unpack_logprobs, unpack_mask, unpack_tokens
from swectl.view.index import RunIndex
from tests.harbor_tools import harbor_validates, run_harbor_python
from tests.test_data_trajectories import REPLIES, _episode_folder, _trained

SLIP = "THOUGHT: look around first.\n\n```bash\nls -"


@pytest.mark.parametrize("per_step", [False, True])
def test_episodes_written_as_atif_pass_harbors_validator_and_read_back_token_exact(
        tiny_tokenizer, tmp_path: Path, per_step: bool) -> None:
    run = tmp_path / "run"
    cfg = EpisodeConfig(per_step_samples=True) if per_step else None
    _episode_folder(run, tiny_tokenizer, "demo__a-1", resolved=True, cfg=cfg, replies=[SLIP, *REPLIES])
    _episode_folder(run, tiny_tokenizer, "demo__b-2", resolved=False, cfg=cfg)
    written = export_runs([run], tmp_path / "atif", model_name="tiny")
    assert [p.name for p in written] == ["demo__a-1__0.atif.json", "demo__b-2__0.atif.json"]
    for path in written:
        valid, said = harbor_validates(path)
        assert valid, said
    doc = read_atif(written[0])
    assert doc.schema_version == SCHEMA_VERSION
    assert [s.source for s in doc.steps] == ["system", "user", "agent", "agent", "agent"]
    first, second = doc.steps[2], doc.steps[3]
    assert first.metrics.extra["loss_mask"] == [0] * len(first.metrics.completion_token_ids)  # the slip
    assert set(second.metrics.extra["loss_mask"]) == {1}
    assert second.tool_calls[0].arguments == {"command": "ls -la"}
    assert second.observation.results[0].content  # what `ls -la` printed, as the next prompt holds it
    assert doc.extra["swectl"]["resolved"] is True and doc.extra["swectl"]["instance_id"] == "demo__a-1"
    back, direct = samples_from_atif([tmp_path / "atif"]), samples_from_runs([run])
    if per_step:  # each step's prompt extends the one before (no context cut): one sample, the same trained tokens
        assert sorted(t for s in back for t in _trained(s)) == sorted(t for s in direct for t in _trained(s))
        assert [s.reward for s in back] == [1.0, 0.0]
    else:  # the very samples of the traj.json reader: tokens, mask, logprobs, reward, uid, weight version
        assert sorted(back, key=lambda s: s.uid) == sorted(direct, key=lambda s: s.uid)


HARBOR_WRITES = r'''
import json, sys
from harbor.models.trajectories import Agent, Metrics, Observation, ObservationResult, Step, ToolCall, Trajectory
call = lambda n: ToolCall(tool_call_id=f"c{n}", function_name="bash", arguments={"command": f"echo {n}"})
steps = [
    Step(step_id=1, source="system", message="You are a terminal agent."),
    Step(step_id=2, source="user", message="Print 1 then 2."),
    Step(step_id=3, source="agent", message="first", tool_calls=[call(1)], is_copied_context=True,
         observation=Observation(results=[ObservationResult(source_call_id="c1", content="1")]),
         metrics=Metrics(prompt_token_ids=[5, 6, 7], completion_token_ids=[8, 9], logprobs=[-0.5, -0.25])),
    Step(step_id=4, source="agent", message="second", tool_calls=[call(2)],
         observation=Observation(results=[ObservationResult(source_call_id="c2", content="2")]),
         metrics=Metrics(prompt_token_ids=[5, 6, 7, 8, 9, 10], completion_token_ids=[11, 12, 13],
                         logprobs=[-1.0, -2.0, -3.0])),
]
with_ids = Trajectory(session_id="s1", agent=Agent(name="terminus-2", version="2.0", model_name="m"), steps=steps)
text_only = Trajectory(session_id="s2", agent=Agent(name="terminus-2", version="2.0"),
                       steps=[s.model_copy(update={"metrics": None}) for s in steps])
for name, t in (("with_ids", with_ids), ("text_only", text_only)):
    with open(f"{sys.argv[1]}/{name}/agent/trajectory.json", "w") as f:
        json.dump(t.to_json_dict(), f)
'''


@pytest.fixture
def harbor_written(tmp_path: Path) -> Path:
    """Two ATIF files written by Harbor's own pydantic models (one with token ids, one text only), laid out as a
    Harbor job folder lays out its trials (``<trial>/agent/trajectory.json``, ``<trial>/result.json``)."""
    job = tmp_path / "job"
    for name, reward in (("with_ids", 1.0), ("text_only", 0.0)):
        (job / name / "agent").mkdir(parents=True)
        (job / name / "result.json").write_text(json.dumps({"verifier_result": {"rewards": {"reward": reward}}}))
    run_harbor_python(HARBOR_WRITES, str(job))
    return job


def test_atif_from_harbor_trains_every_step_but_copied_context(harbor_written: Path, tiny_tokenizer) -> None:
    with_ids, = samples_from_atif([harbor_written / "with_ids"])
    tokens, mask = unpack_tokens(with_ids).tolist(), unpack_mask(with_ids).tolist()
    assert tokens == [5, 6, 7, 8, 9, 10, 11, 12, 13]  # the second call extends the first: one sample
    assert mask == [0, 0, 0, 0, 0, 0, 1, 1, 1]  # the copied step's completion (8, 9) is not trained
    assert unpack_logprobs(with_ids).tolist()[-3:] == [-1.0, -2.0, -3.0]
    text_only, = samples_from_atif([harbor_written / "text_only"], tiny_tokenizer)
    trained = tiny_tokenizer.decode([t for t, m in zip(unpack_tokens(text_only).tolist(),
                                                       unpack_mask(text_only).tolist(), strict=True) if m])
    assert "second" in trained and "first" not in trained
    with pytest.raises(TaskDataError, match="tokenizer"):
        samples_from_atif([harbor_written / "text_only"])
    assert len(atif_files([harbor_written])) == 2  # a job folder: its trials' trajectories


def test_view_opens_atif_written_by_harbor(harbor_written: Path) -> None:
    index = RunIndex(harbor_written)
    assert index.kind == "atif"
    rows = {r.instance_id: r for r in index.episode_rows()}
    assert set(rows) == {"with_ids", "text_only"}
    assert rows["with_ids"].reward == 1.0 and rows["with_ids"].resolved
    assert rows["text_only"].reward == 0.0 and not rows["text_only"].resolved
    episode = index.episode(rows["with_ids"].id)
    assert [m["role"] for m in episode["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [s["action"] for s in episode["steps"]] == ["echo 1", "echo 2"]
    assert [s["copied_context"] for s in episode["steps"]] == [True, False]
    one = RunIndex(harbor_written / "with_ids" / "agent" / "trajectory.json")  # one file alone
    assert [r.instance_id for r in one.episode_rows()] == ["with_ids"]


def test_swectl_data_atif_writes_and_rejects_clearly(tiny_tokenizer, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    _episode_folder(run, tiny_tokenizer, "demo__a-1", resolved=True)
    assert main(["data", "atif", str(run), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "demo__a-1__0.atif.json").is_file()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": "ATIF-v9", "agent": {}, "steps": []}))
    with pytest.raises(TaskDataError, match="ATIF-v9"):
        read_atif(bad)
    bad.write_text(json.dumps({"schema_version": "ATIF-v1.7", "agent": {"name": "x"}, "steps": []}))
    with pytest.raises(TaskDataError, match=r"bad\.json: not an ATIF trajectory"):
        read_atif(bad)
    with pytest.raises(TaskDataError, match="no ATIF trajectory"):
        atif_files([run])


def test_sft_data_tells_atif_from_swectl_runs_and_messages(harbor_written: Path, tiny_tokenizer,
                                                            tmp_path: Path) -> None:
    from swectl.train.plan import _is_atif_source

    run = tmp_path / "run"
    _episode_folder(run, tiny_tokenizer, "demo__a-1", resolved=True)
    messages = tmp_path / "m.json"
    messages.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    assert _is_atif_source(harbor_written)
    assert _is_atif_source(harbor_written / "with_ids" / "agent" / "trajectory.json")
    assert not _is_atif_source(run) and not _is_atif_source(messages)
