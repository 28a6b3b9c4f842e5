"""Group advantages: one number per episode from the rewards of its group (TRAINING.md, "Advantages").

A group is the ``n`` episodes of one task. Each estimator turns the group's rewards into one advantage per
episode, which the batcher copies to the episode's mask-1 tokens:

- ``grpo``: ``(r_i - mean(r)) / (std(r) + eps)`` with the *population* standard deviation (divide by ``n``,
  not ``n - 1``);
- ``drgrpo`` (Dr. GRPO): ``r_i - mean(r)``, no division, so groups with a tiny spread are not up-weighted;
- ``rloo``: ``r_i - mean(r_j for j != i)``, the leave-one-out baseline (unbiased).

A group of one, or a group whose rewards are all equal, carries no signal: every estimator gives exact zeros
(not the rounding noise of ``r - mean(r)``). ``informative`` is the dynamic-sampling test that drops such groups.
Plain Python floats in and out: the controller calls this per group, far from any tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

from swectl.errors import ConfigError

Estimator = Literal["grpo", "drgrpo", "rloo"]
ESTIMATORS: tuple[str, ...] = get_args(Estimator)


def informative(rewards: Sequence[float]) -> bool:
    """True when the rewards are not all equal (a group of zero or one episode is never informative)."""
    return len(set(rewards)) > 1


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _population_std(values: Sequence[float], mean: float) -> float:
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def _grpo(rewards: Sequence[float], eps: float) -> list[float]:
    mean = _mean(rewards)
    scale = _population_std(rewards, mean) + eps
    return [(r - mean) / scale for r in rewards]


def _drgrpo(rewards: Sequence[float]) -> list[float]:
    mean = _mean(rewards)
    return [r - mean for r in rewards]


def _rloo(rewards: Sequence[float]) -> list[float]:
    total = math.fsum(rewards)
    others = len(rewards) - 1
    return [r - (total - r) / others for r in rewards]


def group_advantages(rewards: Sequence[float], estimator: Estimator, eps: float = 1e-6) -> list[float]:
    """The advantage of each episode of one group, in the order of ``rewards``.

    ``grpo`` divides by the population standard deviation of the group plus ``eps``; ``drgrpo`` only
    subtracts the mean; ``rloo`` subtracts the mean of the other episodes' rewards. A group of one, or one whose
    rewards are all equal, gets all zeros. An unknown estimator raises ConfigError.
    """
    if estimator not in ESTIMATORS:
        raise ConfigError(f"unknown advantage estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}")
    if not informative(rewards):
        return [0.0] * len(rewards)
    if estimator == "grpo":
        return _grpo(rewards, eps)
    if estimator == "drgrpo":
        return _drgrpo(rewards)
    return _rloo(rewards)


def advantage_stats(advs: Sequence[float]) -> dict[str, float]:
    """Metrics of a step's advantages: ``mean``, ``std`` (population), ``min``, ``max`` and ``nonzero_frac`` (the
    fraction of episodes with a non-zero advantage, i.e. that carry a learning signal). All 0.0 when empty."""
    if not advs:
        return {"mean": 0.0, "std": 0.0, "min": 0.0, "max": 0.0, "nonzero_frac": 0.0}
    mean = _mean(advs)
    return {
        "mean": mean,
        "std": _population_std(advs, mean),
        "min": float(min(advs)),
        "max": float(max(advs)),
        "nonzero_frac": sum(1 for a in advs if a != 0.0) / len(advs),
    }
