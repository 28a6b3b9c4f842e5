"""An external harness's episode as training data, without a harness process: the gateway's branches become one
sample each (every sampled token in exactly one of them), mini-swe-agent's format errors mask the right turns of
the right branch, SFT reads the branches back from traj.json, and swectl's prompt written as a mini config renders
under mini's own strict Jinja with the variables mini gives it."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import msgspec
import pytest

from swectl.actors.gateway import SessionRecord
from swectl.actors.harness import mini_config, mini_steps, recorded_trajectories
from swectl.actors.rollout import EpisodeResult
from swectl.agent.loop import Episode
from swectl.agent.protocol import ACTION_REGEX, SUBMIT_SENTINEL, AgentTemplates, parse_action
from swectl.config import LossConfig
from swectl.data.trajectories import samples_from_runs
from swectl.gateway.ledger import Ledger
from swectl.rl.batch import unpack_mask, unpack_tokens
from swectl.rl.groups import GradedEpisode, TokenStream, episode_samples
from swectl.train.rollouts import graded_episode


def _recover_session() -> Ledger:
    """mini's shape of a slip: turn 0 is fine, turn 1 is malformed (mini drops it from the next request), turn 2
    continues from turn 0's history and submits."""
    ledger = Ledger()
    ledger.completion(ledger.prompt([1, 2]), [10, 11], [-0.1, -0.2], "3")  # turn 0
    ledger.completion(ledger.prompt([1, 2, 10, 11, 5]), [20], [-0.3], "3")  # turn 1: malformed
    ledger.completion(ledger.prompt([1, 2, 10, 11, 5, 6]), [30, 31], [-0.4, -0.5], "4")  # turn 2: a fork
    return ledger


def _messages() -> list[dict]:
    return [{"role": "system", "content": "s"}, {"role": "user", "content": "task"},
            {"role": "assistant", "content": "look", "extra": {"actions": [{"command": "ls"}]}},
            {"role": "user", "content": "<returncode>0</returncode>"},
            {"role": "user", "content": "Format error", "extra": {"interrupt_type": "FormatError"}},
            {"role": "assistant", "content": "submit", "extra": {"actions": [{"command": "echo done"}]}},
            {"role": "exit", "content": "", "extra": {"exit_status": "Submitted"}}]


def _episode() -> Episode:
    ledger = _recover_session()
    record = SessionRecord(name="t#0", ledger=ledger, stats=ledger.stats())
    streams = recorded_trajectories(record)
    return Episode(instance_id="t", exit_status="Submitted", outcome="COMPLETED", patch="diff",
                   steps=mini_steps(_messages(), record.stats.turns), trajectory=streams[0], branches=streams[1:])


def test_a_branched_session_is_one_sample_per_branch_with_each_sampled_token_once() -> None:
    episode = _episode()
    assert [s.format_error for s in episode.steps] == [False, True, False]
    assert [s.action for s in episode.steps] == ["ls", "", "echo done"]
    assert episode.trajectory.turns == [0, 1] and [b.turns for b in episode.branches] == [[2]]
    result = EpisodeResult(instance_id="t", sample=0, exit_status="Submitted", outcome="COMPLETED", resolved=True)
    graded = graded_episode(result, episode)
    assert graded.weight_version == 3 and graded.mixed_versions  # "3" and "4" across the branches
    samples = episode_samples(graded, 1.0, 1.0)
    assert [s.uid for s in samples] == ["t#0", "t#0.b1"]
    trained = [t for s in samples for t, m in zip(unpack_tokens(s), unpack_mask(s), strict=True) if m]
    assert sorted(trained) == [10, 11, 20, 30, 31]  # every sampled token once, none of the shared prefix twice
    # mask_format_errors finds the malformed turn (1) in the first branch, and leaves the other branch alone
    masked = episode_samples(graded, 1.0, 1.0, loss=LossConfig(mask_format_errors=True))
    trained = [t for s in masked for t, m in zip(unpack_tokens(s), unpack_mask(s), strict=True) if m]
    assert sorted(trained) == [10, 11, 30, 31]


def test_turn_numbers_must_match_the_spans() -> None:
    bad = GradedEpisode(instance_id="t", sample=0, outcome="COMPLETED", resolved=True, token_ids=[1, 2],
                        loss_mask=[0, 1], logprobs=[0.0, -1.0],
                        branches=[TokenStream(token_ids=[1, 3], loss_mask=[0, 1], logprobs=[0.0, -1.0], turns=[1, 2])])
    with pytest.raises(ValueError, match="1 trained spans but 2 turn numbers"):
        episode_samples(bad, 1.0, 1.0)


def test_sft_reads_the_branches_back_and_masks_the_slip(tmp_path: Path) -> None:
    folder = tmp_path / "t__0"
    folder.mkdir()
    episode = _episode()
    (folder / "traj.json").write_bytes(msgspec.json.encode({"format_version": episode.format_version,
                                                            "episode": msgspec.to_builtins(episode)}))
    (folder / "meta.json").write_text(json.dumps({"instance_id": "t", "sample": 0, "exit_status": "Submitted",
                                                  "outcome": "COMPLETED", "resolved": True}))
    samples = samples_from_runs([tmp_path])
    assert [s.uid for s in samples] == ["t#0", "t#0.b1"]
    trained = [t for s in samples for t, m in zip(unpack_tokens(s), unpack_mask(s), strict=True) if m]
    assert sorted(trained) == [10, 11, 30, 31]  # SFT learns the recovery, not the slip


def test_steps_that_do_not_match_the_recorded_turns_are_not_trusted() -> None:
    steps = mini_steps(_messages(), 5)  # the gateway saw more calls than mini recorded
    assert len(steps) == 5 and not any(s.format_error for s in steps)


def test_swectl_prompt_as_a_mini_config_renders_under_minis_strict_jinja() -> None:
    doc = mini_config(AgentTemplates())
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    # the variables mini renders its templates with (agent: task + the environment's config; model: output, and
    # actions/error/finish_reason for a format error)
    system = env.from_string(doc["agent"]["system_template"]).render(task="fix it", cwd="/testbed")
    instance = env.from_string(doc["agent"]["instance_template"]).render(task="fix it", cwd="/testbed")
    observation = env.from_string(doc["model"]["observation_template"]).render(
        output={"output": "x" * 20_000, "returncode": 0, "exception_info": "timed out"})
    error = env.from_string(doc["model"]["format_error_template"]).render(actions=[], error="e", finish_reason="stop")
    assert SUBMIT_SENTINEL in system and "fix it" in instance and "/testbed" in instance
    assert "<exception>timed out</exception>" in observation and "<output_head>" in observation
    assert "it contained 0" in error
    assert doc["model"]["model_class"] == "litellm_textbased" and doc["model"]["action_regex"] == ACTION_REGEX
    # the submit command the prompt shows is one mini's regex reads and swectl's mini environment detects
    assert parse_action(system.split("nothing else:", 1)[1]).startswith(f"echo {SUBMIT_SENTINEL}")


def test_an_episode_that_sampled_nothing_gives_no_sample() -> None:
    """A harness refused at its first turn (its prompt over the context) sampled no token: nothing to train on."""
    empty = GradedEpisode(instance_id="t", sample=0, outcome="TRUNCATED", resolved=False, token_ids=[], loss_mask=[],
                          logprobs=[])
    assert episode_samples(empty, -1.0, 0.0) == []
