"""Process rewards' pure parts (swectl/rl/prm.py): the judge's prompt, votes from its answers, step scores, and the
shaped reward in score_group; the [reward.prm] config checks."""

from __future__ import annotations

import msgspec
import pytest

from swectl.config import PrmConfig, RewardConfig, load_config
from swectl.errors import ConfigError
from swectl.rl.groups import GradedEpisode, Group, score_group
from swectl.rl.prm import JUDGE_SYSTEM, StepView, judge_messages, judgement, parse_vote, process_bonus


@pytest.mark.parametrize(("answer", "vote"), [
    ("good \\boxed{1}", 1), ("\\boxed{+1}", 1), ("\\boxed{ -1 }", -1), ("\\boxed{-1} then \\boxed{1}", 1),
    ("\\boxed{1} then \\boxed{-1}", -1), ("no box", None), ("\\boxed{0}", None), ("\\boxed{2}", None),
    ("\\boxed{yes}", None), ("", None)])
def test_the_last_box_is_the_vote(answer: str, vote: int | None) -> None:
    assert parse_vote(answer) == vote


def test_a_judgement_counts_votes_unparseable_answers_and_failures() -> None:
    j = judgement(3, ["\\boxed{1}", "\\boxed{-1}", "\\boxed{1}", "rambling", None])
    assert (j.step, j.votes, j.unparseable, j.failures) == (3, [1, -1, 1], 1, 1)
    assert j.score == pytest.approx(1 / 3)
    assert judgement(0, [None, "nothing"]).score is None  # no vote: no score, never a made-up one


def test_the_prompt_shows_the_issue_recent_steps_and_the_step_clipped() -> None:
    history = [StepView(step=i, reply=f"reply {i}", observation=f"out {i}") for i in range(6)]
    step = StepView(step=6, reply="edit " + "x" * 5000, observation="ok")
    system, user = judge_messages("the bug", history, step, history_steps=2, max_chars=100)
    assert system == {"role": "system", "content": JUDGE_SYSTEM}
    text = user["content"]
    assert text.startswith("The issue:\nthe bug") and "(4 earlier steps left out)" in text
    assert "reply 3" not in text and "Step 5:\nreply 4" in text and "Step 6:\nreply 5" in text
    assert "The step to judge (step 7)" in text and "characters left out" in text and len(text) < 1000


def _episode(resolved: bool) -> GradedEpisode:
    return GradedEpisode(instance_id="t", sample=0, outcome="COMPLETED", resolved=resolved, token_ids=[1],
                         loss_mask=[1], logprobs=[0.0])


def test_the_reward_is_the_outcome_plus_step_coef_times_the_mean_step_score() -> None:
    episodes = [msgspec_replace(_episode(True), [1.0, None, 0.0]), msgspec_replace(_episode(False), [-1.0]),
                msgspec_replace(_episode(False), [None])]
    judged = RewardConfig(prm=PrmConfig(enabled=True, model="judge", step_coef=0.2))
    group = score_group(Group(instance_id="t", episodes=episodes), shaping=judged)
    assert group.rewards == pytest.approx([1.0 + 0.2 * 0.5, -0.2, 0.0])
    assert score_group(Group(instance_id="t", episodes=episodes)).rewards == [1.0, 0.0, 0.0]  # the judge off
    assert process_bonus([None, None], 0.5) == 0.0


def msgspec_replace(e: GradedEpisode, scores: list[float | None]) -> GradedEpisode:
    return msgspec.structs.replace(e, step_scores=scores)


def test_the_prm_section_is_checked() -> None:
    with pytest.raises(ConfigError, match="one of the two"):
        load_config(None, ["reward.prm.enabled=true"])
    with pytest.raises(ConfigError, match="one of the two"):
        load_config(None, ["reward.prm.enabled=true", "reward.prm.model='m'", "reward.prm.endpoint='http://x'"])
    with pytest.raises(ConfigError, match=r"reward\.prm\.tokenizer"):
        load_config(None, ["reward.prm.enabled=true", "reward.prm.endpoint='http://x'"])
    with pytest.raises(ConfigError, match=r"reward\.prm\.samples"):
        load_config(None, ["reward.prm.samples=0"])
    assert load_config(None, ["reward.prm.enabled=true", "reward.prm.model='m'"]).reward.prm.samples == 3
    with pytest.raises(ConfigError, match=r"experiment\.step_score_advantage .* needs"):
        load_config(None, ["experiment.step_score_advantage=0.5", "reward.prm.enabled=true", "reward.prm.model='m'"])
    load_config(None, ["experiment.step_score_advantage=0.5", "train.sampling.sample_mode='step'",
                       "reward.prm.enabled=true", "reward.prm.model='m'"])
