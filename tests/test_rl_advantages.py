"""Group advantages: every estimator on hand-computed groups, the no-signal groups, and the step's statistics."""

from __future__ import annotations

import math
import random

import pytest

from swectl.errors import ConfigError
from swectl.rl.advantages import ESTIMATORS, advantage_stats, group_advantages, informative

ROOT3 = math.sqrt(3.0)


@pytest.mark.parametrize(("estimator", "rewards", "expected"), [
    # mean 0.25, population std sqrt(0.25 * 0.75) = sqrt(3) / 4
    ("grpo", [1.0, 0.0, 0.0, 0.0], [ROOT3, -1 / ROOT3, -1 / ROOT3, -1 / ROOT3]),
    # population std 0.5 (the sample std would be 0.707 and give +-0.707)
    ("grpo", [1.0, 0.0], [1.0, -1.0]),
    ("grpo", [2.0, 4.0, 6.0], [-math.sqrt(1.5), 0.0, math.sqrt(1.5)]),  # std sqrt(8/3)
    ("drgrpo", [1.0, 0.0, 0.0, 0.0], [0.75, -0.25, -0.25, -0.25]),
    ("drgrpo", [2.0, 4.0, 6.0], [-2.0, 0.0, 2.0]),
    ("rloo", [1.0, 0.0, 0.0, 0.0], [1.0, -1 / 3, -1 / 3, -1 / 3]),
    ("rloo", [1.0, 1.0, 0.0], [0.5, 0.5, -1.0]),
    ("rloo", [2.0, 4.0, 6.0], [-3.0, 0.0, 3.0]),
])
def test_hand_computed_groups(estimator: str, rewards: list[float], expected: list[float]) -> None:
    got = group_advantages(rewards, estimator, eps=0.0)  # type: ignore[arg-type]
    assert got == pytest.approx(expected, abs=1e-12)


def test_grpo_eps_is_added_to_the_std() -> None:
    # std 0.5, + eps 0.5 = 1.0
    assert group_advantages([1.0, 0.0], "grpo", eps=0.5) == pytest.approx([0.5, -0.5])
    default = group_advantages([1.0, 0.0], "grpo")
    assert default == pytest.approx([0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)], abs=1e-12)


def test_grpo_does_not_depend_on_the_reward_scale_but_drgrpo_does() -> None:
    rewards = [0.0, 1.0, 1.0, 0.0, 1.0]
    small = [r * 0.01 for r in rewards]
    assert group_advantages(small, "grpo", eps=0.0) == pytest.approx(group_advantages(rewards, "grpo", eps=0.0))
    assert group_advantages(small, "drgrpo") == pytest.approx([a * 0.01 for a in group_advantages(rewards, "drgrpo")])


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_advantages_sum_to_zero_and_keep_order(estimator: str) -> None:
    rng = random.Random(7)
    rewards = [rng.random() for _ in range(6)]
    advs = group_advantages(rewards, estimator)  # type: ignore[arg-type]
    assert math.fsum(advs) == pytest.approx(0.0, abs=1e-9)
    assert sorted(range(6), key=lambda i: advs[i]) == sorted(range(6), key=lambda i: rewards[i])


def test_rloo_is_drgrpo_scaled_by_n_over_n_minus_one() -> None:
    rng = random.Random(3)
    for n in (2, 3, 8):
        rewards = [rng.choice([0.0, 1.0, 0.5]) for _ in range(n)] + [2.0]
        k = len(rewards)
        dr = group_advantages(rewards, "drgrpo")
        assert group_advantages(rewards, "rloo") == pytest.approx([a * k / (k - 1) for a in dr])


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("rewards", [[1.0], [0.0], [0.1, 0.1, 0.1], [1.0, 1.0, 1.0, 1.0], [0.3] * 7])
def test_no_signal_groups_give_exact_zeros(estimator: str, rewards: list[float]) -> None:
    advs = group_advantages(rewards, estimator)  # type: ignore[arg-type]
    assert advs == [0.0] * len(rewards)
    assert all(type(a) is float for a in advs)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_empty_group(estimator: str) -> None:
    assert group_advantages([], estimator) == []  # type: ignore[arg-type]


def test_unknown_estimator_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'ppo'.*grpo, drgrpo, rloo"):
        group_advantages([1.0, 0.0], "ppo")  # type: ignore[arg-type]


@pytest.mark.parametrize(("rewards", "expected"), [
    ([], False), ([1.0], False), ([0.0, 0.0], False), ([0.5] * 5, False),
    ([0.0, 1.0], True), ([1.0, 1.0, 1.0, 0.0], True), ([0.1, 0.1, 0.10000001], True),
])
def test_informative(rewards: list[float], expected: bool) -> None:
    assert informative(rewards) is expected


def test_advantage_stats() -> None:
    stats = advantage_stats([1.0, -1.0, 0.0, 0.0, 2.0])
    assert stats == pytest.approx({"mean": 0.4, "std": math.sqrt(5.2 / 5), "min": -1.0, "max": 2.0,
                                   "nonzero_frac": 0.6})
    assert all(type(v) is float for v in stats.values())


def test_advantage_stats_of_nothing() -> None:
    assert advantage_stats([]) == {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0, "nonzero_frac": 0.0}
