"""Trajectory readers (swectl/data/trajectories.py): swectl's traj.json episodes and OpenAI-messages JSONL ->
TrainSamples. Episodes are made by the real agent loop (a scripted engine, a fake workspace) and written by the
Rollout actor's own artifact writer, so the files are exactly those of a run."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import anyio
import msgspec
import pytest

from swectl.actors.rollout import EpisodeResult, RolloutConfig, _write_artifacts
from swectl.agent.loop import EpisodeConfig, run_episode
from swectl.agent.protocol import SUBMIT_SENTINEL
from swectl.agent.scripted import ScriptedEngine, end_of_turn_id
from swectl.agent.trajectory import TrajectoryBuilder
from swectl.data.trajectories import samples_from_messages_jsonl, samples_from_runs
from swectl.errors import TaskDataError
from swectl.rl.batch import TrainSample, make_batch, unpack_logprobs, unpack_mask, unpack_tokens
from swectl.schema import ExecResult
from swectl.tasks.record import Task
from swectl.tasks.sources import RowProblemError

REPLIES = [
    "THOUGHT: look around first.\n\n```bash\nls -la\n```",
    f"THOUGHT: done.\n\n```bash\necho {SUBMIT_SENTINEL} && git add -A && git diff --cached\n```",
]
PATCH = "diff --git a/a.py b/a.py\n"


class _Workspace:
    """A sandbox stand-in: `ls` lists a file, the submit command prints the sentinel and a diff."""

    async def exec(self, command: str, timeout: float, *, cwd: str | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        output = f"{SUBMIT_SENTINEL}\n{PATCH}" if SUBMIT_SENTINEL in command else "file.py\n"
        return ExecResult(output=output, exit_code=0, timed_out=False)

    async def diff(self, repo: str | None = None) -> bytes:
        return PATCH.encode()


def _task(instance_id: str) -> Task:
    return Task(instance_id=instance_id, repo="demo/demo", problem_statement="fix it", FAIL_TO_PASS=["t::x"])


def _episode_folder(run: Path, tokenizer, instance_id: str, *, resolved: bool, sample: int = 0,
                    cfg: EpisodeConfig | None = None, meta: bool = True, replies: list[str] = REPLIES) -> Path:
    """Run a scripted episode through the real loop and write it as the Rollout actor does."""
    cfg = cfg or EpisodeConfig()
    engine = ScriptedEngine(replies, tokenizer)
    episode = anyio.run(lambda: run_episode(_task(instance_id), _Workspace(), engine, tokenizer, cfg))
    assert episode.exit_status == "Submitted"
    folder = run / f"{instance_id}__{sample}"
    result = EpisodeResult(instance_id=instance_id, sample=sample, exit_status=episode.exit_status,
                           outcome=episode.outcome, resolved=resolved, artifacts=str(folder))
    _write_artifacts(folder, episode, RolloutConfig(episode=cfg), result)
    if not meta:
        (folder / "meta.json").unlink()
    return folder


def _trained(sample: TrainSample) -> list[int]:
    return [int(t) for t, m in zip(unpack_tokens(sample), unpack_mask(sample), strict=True) if m]


def _script_ids(tokenizer) -> list[int]:
    eot = end_of_turn_id(tokenizer)
    return [t for r in REPLIES for t in [*tokenizer.encode(r, add_special_tokens=False), eot]]


# ---------------------------------------------------------------------------------------------- traj.json


def test_samples_from_a_run_folder_are_the_trajectories_tokens(tiny_tokenizer, tmp_path: Path) -> None:
    run = tmp_path / "run"
    good = _episode_folder(run, tiny_tokenizer, "demo__a-1", resolved=True)
    _episode_folder(run, tiny_tokenizer, "demo__b-2", resolved=False, sample=3)
    samples = samples_from_runs([run])
    assert [s.uid for s in samples] == ["demo__a-1#0", "demo__b-2#3"]
    assert [s.group for s in samples] == ["demo__a-1", "demo__b-2"]
    assert [s.reward for s in samples] == [1.0, 0.0] and all(s.advantage == 1.0 for s in samples)
    traj = json.loads((good / "traj.json").read_text())["episode"]["trajectory"]
    assert unpack_tokens(samples[0]).tolist() == traj["token_ids"]
    assert unpack_mask(samples[0]).tolist() == traj["loss_mask"]
    assert unpack_logprobs(samples[0]).tolist() == traj["logprobs"]
    assert _trained(samples[0]) == _script_ids(tiny_tokenizer)  # mask 1: exactly the scripted replies
    assert samples[0].weight_version == 0 and not samples[0].truncated  # "gold" is not a numeric version
    assert make_batch(0, "sft", samples).loss_tokens == 2 * len(_script_ids(tiny_tokenizer))


@pytest.mark.parametrize("per_step", [False, True])
def test_malformed_replies_carry_no_loss(tiny_tokenizer, tmp_path: Path, per_step: bool) -> None:
    """A reply the loop rejected (no bash block) is in the tokens but not trained; the recovery after it is."""
    slip = "THOUGHT: look around first.\n\n```bash\nls -"
    cfg = EpisodeConfig(per_step_samples=True) if per_step else None
    folder = _episode_folder(tmp_path / "run", tiny_tokenizer, "demo__a-1", resolved=True, cfg=cfg,
                             replies=[slip, *REPLIES])
    steps = json.loads((folder / "traj.json").read_text())["episode"]["steps"]
    assert [s["format_error"] for s in steps] == [True, False, False]
    samples = samples_from_runs([folder])
    trained = [t for s in samples for t in _trained(s)]
    assert trained == _script_ids(tiny_tokenizer)  # the two good replies, not the slip
    assert tiny_tokenizer.encode(slip, add_special_tokens=False)[0] in unpack_tokens(samples[0]).tolist()


def test_resolved_only_keeps_resolved_episodes(tiny_tokenizer, tmp_path: Path) -> None:
    run = tmp_path / "run"
    good = _episode_folder(run, tiny_tokenizer, "demo__a-1", resolved=True)
    _episode_folder(run, tiny_tokenizer, "demo__b-2", resolved=False)
    assert [s.uid for s in samples_from_runs([run], resolved_only=True)] == ["demo__a-1#0"]
    # a traj.json file and an episode folder name the same episode
    assert samples_from_runs([good / "traj.json"]) == samples_from_runs([good])


def test_resolved_only_needs_meta_json(tiny_tokenizer, tmp_path: Path) -> None:
    folder = _episode_folder(tmp_path, tiny_tokenizer, "demo__a-1", resolved=True, meta=False)
    assert [s.reward for s in samples_from_runs([folder])] == [1.0]  # no grade known: SFT data as given
    with pytest.raises(TaskDataError, match=r"meta\.json.*resolved_only"):
        samples_from_runs([folder], resolved_only=True)


def test_aborted_and_chat_episodes_are_skipped_with_a_warning(tiny_tokenizer, tmp_path: Path, caplog) -> None:
    run = tmp_path / "run"
    _episode_folder(run, tiny_tokenizer, "demo__a-1", resolved=True)
    aborted = _episode_folder(run, tiny_tokenizer, "demo__b-2", resolved=False)
    doc = json.loads((aborted / "traj.json").read_text())
    doc["episode"].update(outcome="ABORTED", exit_status="Aborted")
    (aborted / "traj.json").write_text(json.dumps(doc))
    chat = _episode_folder(run, tiny_tokenizer, "demo__c-3", resolved=False)
    doc = json.loads((chat / "traj.json").read_text())
    doc["episode"]["trajectory"].update(token_ids=[], loss_mask=[], logprobs=[])
    (chat / "traj.json").write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="swectl"):
        assert [s.uid for s in samples_from_runs([run])] == ["demo__a-1#0"]
    assert "1 episodes: aborted" in caplog.text and "1 episodes: no token ids" in caplog.text


def test_per_step_episodes_give_one_sample_per_step(tiny_tokenizer, tmp_path: Path) -> None:
    folder = _episode_folder(tmp_path, tiny_tokenizer, "demo__a-1", resolved=True,
                             cfg=EpisodeConfig(per_step_samples=True))
    samples = samples_from_runs([folder])
    assert [s.uid for s in samples] == ["demo__a-1#0.0", "demo__a-1#0.1"]
    eot = end_of_turn_id(tiny_tokenizer)
    for sample, reply in zip(samples, REPLIES, strict=True):
        assert _trained(sample) == [*tiny_tokenizer.encode(reply, add_special_tokens=False), eot]
        assert unpack_mask(sample).tolist()[0] == 0  # the prompt leads


def test_bad_run_paths_say_why(tiny_tokenizer, tmp_path: Path) -> None:
    with pytest.raises(TaskDataError, match="no such file"):
        samples_from_runs([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskDataError, match=r"no traj\.json"):
        samples_from_runs([tmp_path / "empty"])
    folder = _episode_folder(tmp_path, tiny_tokenizer, "demo__a-1", resolved=True)
    doc = json.loads((folder / "traj.json").read_text())
    (folder / "traj.json").write_text(json.dumps({**doc, "format_version": 99}))
    with pytest.raises(TaskDataError, match="format_version 99"):
        samples_from_runs([folder])
    (folder / "traj.json").write_text("{not json")
    with pytest.raises(TaskDataError, match="not JSON"):
        samples_from_runs([folder])


# ---------------------------------------------------------------------------------------------- messages JSONL


CONVERSATION = [
    {"role": "system", "content": "You are a software engineer."},
    {"role": "user", "content": "Fix the bug."},
    {"role": "assistant", "content": REPLIES[0]},
    {"role": "user", "content": [{"type": "text", "text": "<returncode>0</returncode>\n"},
                                 {"type": "text", "text": "<output>\nfile.py\n</output>"}]},
    {"role": "assistant", "content": [{"type": "text", "text": REPLIES[1]}]},
]


def _write_jsonl(path: Path, rows: list[object | bytes]) -> Path:
    lines = [r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_messages_are_tokenized_with_the_template_and_assistant_turns_masked(tiny_tokenizer, tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "trajs.jsonl", [{"instance_id": "demo__a-1", "messages": CONVERSATION}])
    [sample] = samples_from_messages_jsonl(path, tiny_tokenizer)
    assert sample.uid == "demo__a-1#1" and sample.group == "demo__a-1"
    assert sample.advantage == 1.0 and sample.reward == 1.0
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])} for m in CONVERSATION]
    rendered = tiny_tokenizer.apply_chat_template(flat, tokenize=True)  # a BatchEncoding in transformers 5
    assert unpack_tokens(sample).tolist() == list(getattr(rendered, "input_ids", rendered))
    # mask 1: each reply and its <|im_end|>, not the newline the template adds after it
    assert _trained(sample) == _script_ids(tiny_tokenizer)
    assert tiny_tokenizer.decode(_trained(sample)) == "<|im_end|>".join(REPLIES) + "<|im_end|>"
    assert not unpack_logprobs(sample).any()


def test_messages_and_the_agent_loop_give_the_same_tokens_and_mask(tiny_tokenizer, tmp_path: Path) -> None:
    """The same conversation read from messages and built token-in/token-out by the loop's builder agree (the
    builder stops at the last <|im_end|>; the rendering adds the template's newline after it)."""
    builder = TrajectoryBuilder(tiny_tokenizer)
    builder.start(CONVERSATION[0]["content"], CONVERSATION[1]["content"])
    eot = end_of_turn_id(tiny_tokenizer)
    for n, reply in enumerate(REPLIES):
        if n:
            builder.add_observation("<returncode>0</returncode>\n<output>\nfile.py\n</output>")
        ids = [*tiny_tokenizer.encode(reply, add_special_tokens=False), eot]
        builder.add_output(ids, [0.0] * len(ids), "gold")
    path = _write_jsonl(tmp_path / "trajs.jsonl", [{"messages": CONVERSATION}])
    [sample] = samples_from_messages_jsonl(path, tiny_tokenizer)
    tokens, mask = unpack_tokens(sample).tolist(), unpack_mask(sample).tolist()
    assert tokens[:-1] == builder.traj.token_ids and tiny_tokenizer.decode(tokens[-1:]) == "\n"
    assert mask[:-1] == builder.traj.loss_mask and mask[-1] == 0


@pytest.mark.parametrize("lead", ["", "\n\n  ", " ", "\t"], ids=["plain", "newlines", "space", "tab"])
def test_the_fast_mask_equals_the_exact_one(tiny_tokenizer, tmp_path: Path, lead: str) -> None:
    """Masks come from text bounds tokenized piece by piece when that gives the whole conversation's tokens,
    else from tokenized prefixes (a reply starting with whitespace can merge with the template's newline)."""
    from swectl.data.trajectories import _mask_by_tokens, _render

    conversation = [dict(m) for m in CONVERSATION]
    conversation[2]["content"] = lead + REPLIES[0]
    path = _write_jsonl(tmp_path / "trajs.jsonl", [{"messages": conversation}])
    [sample] = samples_from_messages_jsonl(path, tiny_tokenizer)
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])} for m in conversation]
    ids = _render(tiny_tokenizer, flat, generation_prompt=False)
    assert unpack_tokens(sample).tolist() == ids
    assert unpack_mask(sample).tolist() == _mask_by_tokens(flat, tiny_tokenizer, end_of_turn_id(tiny_tokenizer), ids,
                                                           "x")


def test_gzipped_jsonl_and_uids_without_an_instance_id(tiny_tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "smith.jsonl.gz"
    path.write_bytes(gzip.compress((json.dumps({"messages": CONVERSATION}) + "\n\n"
                                    + json.dumps({"traj_id": "t-9", "messages": CONVERSATION}) + "\n").encode()))
    samples = samples_from_messages_jsonl(path, tiny_tokenizer)
    assert [s.uid for s in samples] == ["smith.jsonl.gz#1", "t-9#3"]


BAD_ROWS: list[tuple[object | bytes, str]] = [
    (b"{not json", "(row): not valid JSON"),
    ({"conversation": []}, "messages: missing"),
    ({"messages": []}, "messages: expected a non-empty list"),
    ({"messages": [{"role": "narrator", "content": "x"}, CONVERSATION[2]]}, "messages[0].role: 'narrator'"),
    ({"messages": [CONVERSATION[1], {"role": "assistant", "content": "  "}]}, "messages[1].content: empty"),
    ({"messages": [CONVERSATION[1], {"role": "assistant", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages[1].content[0]: expected a {\"type\": \"text\""),
    ({"messages": [CONVERSATION[1], {"role": "assistant", "content": 7}]}, "messages[1].content: expected a string"),
    ({"messages": [CONVERSATION[1], {"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
     "messages[1].tool_calls: tool calls are not supported"),
    ({"messages": CONVERSATION[:2]}, "messages: no assistant message"),
    (b'{"messages": [{"role": "assistant", "content": "caf\xe9"}]}', "(row): not UTF-8 (byte 51: b'\\xe9')"),
    (b'{"messages": [{"role": "assistant", "content": "\\ud800"}]}', "messages[0].content: not valid Unicode"),
    ([1, 2], "row: expected a JSON object"),
]


def test_bad_rows_are_skipped_counted_and_reported(tiny_tokenizer, tmp_path: Path, caplog) -> None:
    rows = [{"messages": CONVERSATION}, *(row for row, _ in BAD_ROWS), {"messages": CONVERSATION}]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="swectl"):
        samples = samples_from_messages_jsonl(path, tiny_tokenizer)
    assert [s.uid for s in samples] == ["mixed.jsonl#1", f"mixed.jsonl#{len(rows)}"]
    assert f"skipped {len(BAD_ROWS)} bad rows of {len(rows)}" in caplog.text
    for line, (_, problem) in enumerate(BAD_ROWS, start=2):
        shown = f"{path}:{line}: {problem}" if line - 2 < 10 else ""
        assert shown in caplog.text, shown
    assert f"... and {len(BAD_ROWS) - 10} more" in caplog.text


@pytest.mark.parametrize(("row", "problem"), BAD_ROWS, ids=[p.split(":")[0] + f"-{i}" for i, (_, p) in
                                                            enumerate(BAD_ROWS)])
def test_strict_makes_a_bad_row_fatal(tiny_tokenizer, tmp_path: Path, row: object, problem: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": CONVERSATION}, row])
    with pytest.raises(RowProblemError) as caught:
        samples_from_messages_jsonl(path, tiny_tokenizer, strict=True)
    assert isinstance(caught.value, TaskDataError)
    assert str(caught.value).startswith(f"{path}:2: {problem}")


def test_an_unreadable_file_is_an_error(tiny_tokenizer, tmp_path: Path) -> None:
    with pytest.raises(TaskDataError, match="cannot read"):
        samples_from_messages_jsonl(tmp_path / "missing.jsonl", tiny_tokenizer)


def test_samples_survive_msgpack(tiny_tokenizer, tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "trajs.jsonl", [{"messages": CONVERSATION}])
    samples = samples_from_messages_jsonl(path, tiny_tokenizer)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(samples), type=list[TrainSample]) == samples
