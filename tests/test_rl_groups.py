"""From graded episodes to samples: rewards, advantages copied to every trained token, per-step samples,
truncated episodes masked, pass@k, and the training config's cross-field checks."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from swectl.config import AdvantageConfig, ExperimentConfig, LossConfig, RewardConfig, load_config
from swectl.errors import ConfigError
from swectl.rl.batch import make_batch, unpack_logprobs, unpack_mask, unpack_tokens
from swectl.rl.groups import (
    GradedEpisode,
    Group,
    episode_samples,
    group_samples,
    mask_turns,
    masked_as_truncated,
    pass_at_k,
    score_group,
    turn_spans,
)


def _score(group: Group, estimator: str = "grpo", *, reward: RewardConfig | None = None, shuffle_key: str = "",
           **experiment: object) -> Group:
    """score_group with the [train.advantage] estimator and [experiment] knobs given by name."""
    return score_group(group, AdvantageConfig(estimator=estimator), reward or RewardConfig(),
                       ExperimentConfig(**experiment),
                       shuffle_key=shuffle_key)


LOSS_MASKS = ("mask_truncated", "mask_truncated_endings", "mask_format_errors")  # [train.loss]; the rest [experiment]


def _knobs(knobs: dict[str, object]) -> dict[str, object]:
    """The experiment= and loss= arguments for knobs given by name; per-step samples at the episode's full advantage
    unless the test weighs them (step_sample_weight)."""
    loss = {k: v for k, v in knobs.items() if k in LOSS_MASKS}
    experiment = {"step_sample_weight": "none", **{k: v for k, v in knobs.items() if k not in LOSS_MASKS}}
    return {"experiment": ExperimentConfig(**experiment), "loss": LossConfig(**loss)}  # type: ignore[arg-type]


def _samples(groups: list[Group], mode: str = "episode", **knobs: object) -> list:
    """group_samples with [train.loss] masks and [experiment] knobs by name."""
    return group_samples(groups, mode=mode, **_knobs(knobs))  # type: ignore[arg-type]


def _one(episode: GradedEpisode, advantage: float, reward: float, mode: str = "episode", **knobs: object) -> list:
    return episode_samples(episode, advantage, reward, mode=mode, **_knobs(knobs))  # type: ignore[arg-type]


def _episode(sample: int, resolved: bool, outcome: str = "COMPLETED") -> GradedEpisode:
    return GradedEpisode(instance_id="t", sample=sample, outcome=outcome, resolved=resolved,
                         token_ids=[1, 2, 3, 4, 5], loss_mask=[0, 0, 1, 1, 0], logprobs=[0, 0, -0.5, -0.25, 0],
                         weight_version=3,
                         steps=[([1, 2], [3], [-0.5]), ([1, 2, 3, 9], [4], [-0.25])])


def test_grpo_group_scores_and_samples() -> None:
    group = _score(Group(instance_id="t", episodes=[_episode(0, True), _episode(1, False)]), "grpo")
    assert group.rewards == [1.0, 0.0] and group.informative
    assert group.advantages[0] == pytest.approx(1.0, abs=1e-5) and group.advantages[1] == pytest.approx(-1.0, abs=1e-5)
    samples = _samples([group])
    assert [s.uid for s in samples] == ["t#0", "t#1"]
    assert unpack_tokens(samples[0]).tolist() == [1, 2, 3, 4, 5]
    assert unpack_mask(samples[0]).tolist() == [0, 0, 1, 1, 0]
    assert np.allclose(unpack_logprobs(samples[0]), [0, 0, -0.5, -0.25, 0])
    assert samples[0].weight_version == 3 and samples[1].reward == 0.0
    batch = make_batch(1, "grpo", samples)
    assert batch.loss_tokens == 4 and batch.sequences == 2


def test_custom_rewards_and_the_control_run() -> None:
    group = _score(Group(instance_id="t", episodes=[_episode(0, True), _episode(1, False)]), "drgrpo",
                        reward=RewardConfig(resolved=2.0, unresolved=-1.0))
    assert group.rewards == [2.0, -1.0] and group.advantages == [1.5, -1.5]
    control = _score(Group(instance_id="t", episodes=[_episode(0, True), _episode(1, False)]), "rloo",
                          zero_advantages=True)
    assert control.rewards == [1.0, 0.0] and control.advantages == [0.0, 0.0]


def test_positive_advantages_only() -> None:
    episodes = [_episode(0, True), _episode(1, False), _episode(2, False), _episode(3, False)]
    full = _score(Group(instance_id="t", episodes=list(episodes)), "drgrpo")
    assert full.advantages == [0.75, -0.25, -0.25, -0.25]
    positive = _score(Group(instance_id="t", episodes=list(episodes)), "drgrpo", positive_advantages_only=True)
    assert positive.rewards == full.rewards and positive.advantages == [0.75, 0.0, 0.0, 0.0]
    control = _score(Group(instance_id="t", episodes=list(episodes)), "drgrpo", positive_advantages_only=True,
                          zero_advantages=True)
    assert control.advantages == [0.0] * 4


def test_positive_advantage_scale() -> None:
    episodes = [_episode(0, True), _episode(1, False), _episode(2, False), _episode(3, False)]
    scaled = _score(Group(instance_id="t", episodes=list(episodes)), "drgrpo", positive_advantage_scale=0.1)
    assert scaled.advantages == pytest.approx([0.075, -0.25, -0.25, -0.25])
    negative_only = _score(Group(instance_id="t", episodes=list(episodes)), "drgrpo",
                                positive_advantage_scale=0.0)
    assert negative_only.advantages == [0.0, -0.25, -0.25, -0.25]


def test_shuffled_rewards_control() -> None:
    episodes = [_episode(i, i < 2) for i in range(8)]
    real = _score(Group(instance_id="t", episodes=list(episodes)), "grpo")
    orders = set()
    for seed in range(20):
        control = _score(Group(instance_id="t", episodes=list(episodes)), "grpo",
                              shuffle_rewards=True, shuffle_key=f"s{seed}")
        assert control.rewards == real.rewards  # the metrics see the true rewards
        assert sorted(control.advantages) == pytest.approx(sorted(real.advantages))
        orders.add(tuple(a > 0 for a in control.advantages))
        again = _score(Group(instance_id="t", episodes=list(episodes)), "grpo",
                            shuffle_rewards=True, shuffle_key=f"s{seed}")
        assert again.advantages == control.advantages  # seeded: a resumed run draws the same
    assert len(orders) > 5  # the positive advantages land on other episodes than the resolved ones


def test_equal_rewards_carry_no_signal() -> None:
    group = _score(Group(instance_id="t", episodes=[_episode(0, False), _episode(1, False)]), "grpo")
    assert not group.informative and group.advantages == [0.0, 0.0]
    assert pass_at_k([group]) == 0.0


def test_step_mode_gives_one_sample_per_turn_sharing_the_advantage() -> None:
    group = _score(Group(instance_id="t", episodes=[_episode(0, True), _episode(1, False)]), "rloo")
    samples = _samples([group], "step")
    assert [s.uid for s in samples] == ["t#0.0", "t#0.1", "t#1.0", "t#1.1"]
    assert unpack_tokens(samples[1]).tolist() == [1, 2, 3, 9, 4]
    assert unpack_mask(samples[1]).tolist() == [0, 0, 0, 0, 1]
    assert samples[0].advantage == samples[1].advantage == 1.0


def test_step_samples_can_weigh_each_episode_once_and_carry_their_judge_score() -> None:
    episodes = [msgspec.structs.replace(_episode(0, True), step_scores=[1.0, None]), _episode(1, False)]
    group = _score(Group(instance_id="t", episodes=episodes), "rloo")
    weighted = _samples([group], "step", step_sample_weight="episode")
    assert [s.advantage for s in weighted] == [0.5, 0.5, -0.5, -0.5]  # each of 2 steps: half the advantage
    shaped = _samples([group], "step", step_score_advantage=0.25)
    assert [s.advantage for s in shaped] == [1.25, 1.0, -1.0, -1.0]  # a step without a score keeps the episode's
    both = _samples([group], "step", step_sample_weight="episode", step_score_advantage=0.25)
    assert [s.advantage for s in both] == [0.625, 0.5, -0.5, -0.5]
    assert _samples([group], step_sample_weight="episode")[0].advantage == 1.0  # episode mode: one sample, as is


def test_truncated_episodes_can_be_masked() -> None:
    episodes = [_episode(0, False, "TRUNCATED"), _episode(1, True)]
    group = _score(Group(instance_id="t", episodes=episodes), "grpo")
    masked = _samples([group], mask_truncated=True)
    assert unpack_mask(masked[0]).sum() == 0 and masked[0].truncated
    assert unpack_mask(masked[1]).sum() == 2
    assert unpack_mask(_samples([group])[0]).sum() == 2


def test_mask_truncated_masks_only_the_endings_it_is_given() -> None:
    """The step limit's ending is masked; with the overlong endings alone, an episode the malformed-reply limit
    ended keeps its well-formed turns (its malformed one stays masked by mask_format_errors)."""
    step_limit = msgspec.structs.replace(_three_turns([False, False, False], outcome="TRUNCATED", resolved=False),
                                         exit_status="LimitsExceeded")
    malformed = msgspec.structs.replace(_three_turns([False, True, True], outcome="TRUNCATED", resolved=False),
                                        sample=1, exit_status="FormatError")
    resolved = msgspec.structs.replace(_three_turns([False, False, False], outcome="COMPLETED", resolved=True),
                                       sample=2, exit_status="Submitted")
    group = _score(Group(instance_id="t", episodes=[step_limit, malformed, resolved]), "grpo")
    everything = _samples([group], mask_truncated=True, mask_format_errors=True)
    assert [int(unpack_mask(s).sum()) for s in everything] == [0, 0, 5]
    overlong = _samples([group], mask_truncated=True, mask_format_errors=True,
                             mask_truncated_endings=["LimitsExceeded", "TimeExceeded", "ContextExceeded"])
    assert [int(unpack_mask(s).sum()) for s in overlong] == [0, 2, 5]
    assert unpack_mask(overlong[1]).tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert overlong[1].advantage < 0
    unknown = msgspec.structs.replace(malformed, exit_status="")  # an exit status not known: any truncated ending
    assert masked_as_truncated(unknown, ["LimitsExceeded"]) and not masked_as_truncated(resolved)


def _three_turns(format_errors: list[bool], *, outcome: str, resolved: bool) -> GradedEpisode:
    """Three turns, each one span of the loss mask (2, 1 and 2 tokens)."""
    return GradedEpisode(instance_id="t", sample=0, outcome=outcome, resolved=resolved,
                         token_ids=list(range(10)), loss_mask=[0, 1, 1, 0, 1, 0, 0, 1, 1, 0],
                         logprobs=[0.0] * 10, format_errors=format_errors,
                         steps=[([0], [1, 2], [0.0, 0.0]), ([0, 1, 2, 3], [4], [0.0]),
                                ([0, 1, 2, 3, 4, 5, 6], [7, 8], [0.0, 0.0])])


def test_turns_after_the_first_malformed_reply_can_be_masked() -> None:
    """Three turns (spans of the loss mask); the second was malformed: it keeps its loss, the third does not."""
    episode = _three_turns([False, True, True], outcome="TRUNCATED", resolved=False)
    clean = msgspec.structs.replace(episode, format_errors=[False, False, False])
    group = _score(Group(instance_id="t", episodes=[episode, clean]), "drgrpo")
    cut, untouched = _samples([group], mask_after_format_error=True)
    assert unpack_mask(cut).tolist() == [0, 1, 1, 0, 1, 0, 0, 0, 0, 0]
    assert unpack_mask(untouched).tolist() == clean.loss_mask
    assert unpack_mask(_samples([group])[0]).tolist() == episode.loss_mask  # off by default
    steps = _samples([group], "step", mask_after_format_error=True)[:3]
    assert [int(unpack_mask(s).sum()) for s in steps] == [2, 1, 0]
    # the same episode with a positive advantage: the malformed reply is not reinforced either
    good = _one(episode, 1.0, 1.0, mask_after_format_error=True)[0]
    assert unpack_mask(good).tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    first = msgspec.structs.replace(episode, format_errors=[True, True, True])
    assert unpack_mask(_one(first, 1.0, 1.0, mask_after_format_error=True)[0]).sum() == 0
    assert unpack_mask(_one(first, -1.0, 0.0, mask_after_format_error=True)[0]).sum() == 2


def test_malformed_replies_themselves_can_be_masked() -> None:
    """mask_format_errors: the malformed turns carry no loss whatever the advantage; the turns around them train."""
    episode = _three_turns([False, True, False], outcome="COMPLETED", resolved=True)
    for advantage in (1.0, -1.0):
        [sample] = _one(episode, advantage, 1.0, mask_format_errors=True)
        assert unpack_mask(sample).tolist() == [0, 1, 1, 0, 0, 0, 0, 1, 1, 0]
    steps = _one(episode, 1.0, 1.0, "step", mask_format_errors=True)
    assert [int(unpack_mask(s).sum()) for s in steps] == [2, 0, 2]
    # with mask_after_format_error too, a failed episode keeps only the turns before its first slip
    [both] = _one(episode, -1.0, 0.0, mask_format_errors=True, mask_after_format_error=True)
    assert unpack_mask(both).tolist() == [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert unpack_mask(_one(episode, 1.0, 1.0)[0]).tolist() == episode.loss_mask  # off by default


def test_turn_spans_and_masking_turns_by_number() -> None:
    mask = [0, 1, 1, 0, 1, 0, 0, 1, 1]
    assert turn_spans(mask) == [(1, 3), (4, 5), (7, 9)]
    assert mask_turns(mask, [0, 2]) == [0, 0, 0, 0, 1, 0, 0, 0, 0]
    assert mask_turns(mask, []) == mask
    with pytest.raises(ValueError, match="turn 3 has no trained span"):
        mask_turns(mask, [3])


def test_a_resolved_episode_that_never_submitted_can_count_as_unresolved() -> None:
    episodes = [_episode(0, True, "TRUNCATED"), _episode(1, True), _episode(2, False)]
    graded = _score(Group(instance_id="t", episodes=list(episodes)), "drgrpo")
    assert graded.rewards == [1.0, 1.0, 0.0]
    strict = _score(Group(instance_id="t", episodes=list(episodes)), "drgrpo", reward_requires_submit=True)
    assert strict.rewards == [0.0, 1.0, 0.0]
    assert strict.advantages[0] < 0 < strict.advantages[1]


def test_an_episode_that_never_submitted_can_cost_more_than_a_wrong_submission() -> None:
    episodes = [_episode(0, False, "TRUNCATED"), _episode(1, False), _episode(2, True), _episode(3, True, "TRUNCATED")]
    plain = _score(Group(instance_id="t", episodes=list(episodes)), "drgrpo")
    assert plain.rewards == [0.0, 0.0, 1.0, 1.0]
    penalised = _score(Group(instance_id="t", episodes=list(episodes)), "drgrpo", truncated_reward=-0.25)
    assert penalised.rewards == [-0.25, 0.0, 1.0, 1.0]  # a truncated episode whose diff resolves still counts as solved
    assert penalised.advantages[0] < penalised.advantages[1] < 0 < penalised.advantages[2]
    strict = _score(Group(instance_id="t", episodes=list(episodes)), "drgrpo", truncated_reward=-0.25,
                         reward_requires_submit=True)
    assert strict.rewards == [-0.25, 0.0, 1.0, -0.25]
    # a group of wrong submissions and step-limit endings now carries a signal: submit
    no_solve = _score(Group(instance_id="t", episodes=episodes[:2]), "grpo", truncated_reward=-0.25)
    assert no_solve.informative and no_solve.advantages[0] < 0 < no_solve.advantages[1]


def test_truncated_reward_is_checked_against_the_other_rewards_and_the_mask() -> None:
    assert load_config(None, ["experiment.truncated_reward=-0.25"]).experiment.truncated_reward == -0.25
    with pytest.raises(ConfigError, match=r"truncated_reward .* must be below reward.resolved"):
        load_config(None, ["experiment.truncated_reward=1.0"])
    with pytest.raises(ConfigError, match="carry no gradient; leave LimitsExceeded out"):
        load_config(None, ["experiment.truncated_reward=-0.25", "train.loss.mask_truncated=true"])
    config = load_config(None, ["experiment.truncated_reward=-0.25", "train.loss.mask_truncated=true",
                                'train.loss.mask_truncated_endings=["TimeExceeded", "ContextExceeded", "FormatError"]'])
    assert config.train.loss.mask_truncated and config.experiment.truncated_reward == -0.25


def test_the_masks_and_the_sft_data_choice_moved_out_of_experiment_say_where() -> None:
    for old, new in (("experiment.mask_truncated=true", "train.loss.mask_truncated"),
                     ("experiment.mask_format_errors=true", "train.loss.mask_format_errors"),
                     ("experiment.sft_resolved_only=false", "train.data.sft_resolved_only")):
        with pytest.raises(ConfigError, match=f"{old.split('=')[0]} is now {new}"):
            load_config(None, [old])
    assert load_config(None, ["train.data.sft_resolved_only=false"]).train.data.sft_resolved_only is False


@pytest.mark.parametrize(("override", "message"), [
    ("train.sampling.n_samples=1", "n_samples"),
    ("train.algorithm='ppo'", "algorithm"),
    ("train.data.sft_steps=30", "sft_steps"),
    ("reward.resolved=0.0", "reward.resolved"),
    ("trainer.nodes=['gpu9']", "trainer.nodes"),
    ("train.optim.lr=0", "lr"),
    ("trainer.nproc_per_node=[2, 1]", "one number per node of trainer.nodes"),
])
def test_train_config_errors_name_the_knob(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_the_truncated_endings_are_the_agent_loops_truncated_exit_statuses() -> None:
    from swectl.agent.loop import OUTCOME
    from swectl.config import TRUNCATED_ENDINGS

    assert sorted(TRUNCATED_ENDINGS) == sorted(s for s, outcome in OUTCOME.items() if outcome == "TRUNCATED")
    assert LossConfig().mask_truncated_endings == list(TRUNCATED_ENDINGS)


def test_the_ranks_get_every_loss_key_but_the_sample_masks() -> None:
    """The masks live in [train.loss] but act on the controller's side: the ranks' settings take every other key
    (a run with a mask on starts its trainer; the soak found the masks' move had broken that)."""
    from swectl.config import OptimConfig, TrainerConfig
    from swectl.rl.wire import LOSS_MASKS, TrainerSettings

    loss_keys = set(LossConfig.__struct_fields__)
    assert LOSS_MASKS <= loss_keys and not LOSS_MASKS & set(TrainerSettings.__struct_fields__)
    assert loss_keys - LOSS_MASKS <= set(TrainerSettings.__struct_fields__)
    settings = TrainerSettings.of(TrainerConfig(), OptimConfig(), LossConfig(mask_truncated=True, kl_coef=0.5),
                                  model="m", out_dir="o")
    assert settings.kl_coef == 0.5
