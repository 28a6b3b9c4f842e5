"""From graded episodes to training samples: rewards, groups, advantages (pure; no I/O).

A group is the ``n`` episodes of one task. ABORTED episodes are never rewards (docs/architecture.md 12.1): the
controller drops them and refills the group before it gets here. A group whose rewards are all equal carries no signal
(dynamic sampling drops it). Each episode's advantage is copied to its samples: one sample per episode (its
whole token stream), or in ``step`` mode one sample per agent step (the exact prompt the engine saw, mask 0,
and what it emitted, mask 1), all sharing the episode's advantage.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from swectl.config import TRUNCATED_ENDINGS, AdvantageConfig, ExperimentConfig, LossConfig, RewardConfig
from swectl.rl.advantages import group_advantages, informative
from swectl.rl.batch import TrainSample, pack_sample
from swectl.rl.prm import process_bonus

SampleMode = Literal["episode", "step"]
DEFAULT_ADVANTAGE = AdvantageConfig()
DEFAULT_REWARD = RewardConfig()
DEFAULT_EXPERIMENT = ExperimentConfig()
DEFAULT_LOSS = LossConfig()


class TokenStream(msgspec.Struct, frozen=True, kw_only=True):
    """One more token sequence of an episode (a branch of an external harness's gateway session): ids, loss mask,
    logprobs and the turn number of each trained span."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    turns: list[int] = []


class GradedEpisode(msgspec.Struct, frozen=True, kw_only=True):
    """What the batcher needs of one finished, graded episode."""

    instance_id: str
    sample: int
    outcome: str  # COMPLETED | TRUNCATED (ABORTED episodes never get here)
    resolved: bool
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_version: int = 0  # the oldest policy version among its turns
    mixed_versions: bool = False  # its turns were sampled by more than one policy version (async training)
    step_scores: list[float | None] = []  # [reward.prm]: the judge's score per agent step (None: no vote parsed)
    steps: list[tuple[list[int], list[int], list[float]]] = []  # per step: prompt ids, output ids, logprobs
    format_errors: list[bool] = []  # per agent turn: the reply was malformed (no single bash block)
    exit_status: str = ""  # the agent loop's (Submitted, LimitsExceeded, FormatError, ...); "" when not known
    tampered: bool = False  # the grader graded its patch "tampered" (docs/grading.md): rewarded as unresolved
    turns: list[int] = []  # the turn number of each trained span of token_ids ([]: span i is turn i)
    branches: list[TokenStream] = []  # an external harness's other branches: each its own sample, same advantage

    @property
    def truncated(self) -> bool:
        """The step limit or malformed replies ended it before it submitted."""
        return self.outcome == "TRUNCATED"


REWARDS_FILE = "rewards.jsonl"  # in an episodes folder: one EpisodeReward per scored episode (`swectl view` reads it)


class EpisodeReward(msgspec.Struct, frozen=True):
    """What a scored episode got: its folder is ``<instance_id>__<sample>`` beside the rewards file."""

    instance_id: str
    sample: int
    reward: float
    advantage: float


class Group(msgspec.Struct, kw_only=True):
    """The episodes of one task with their rewards and advantages."""

    instance_id: str
    episodes: list[GradedEpisode]
    rewards: list[float] = []
    advantages: list[float] = []

    @property
    def informative(self) -> bool:
        return informative(self.rewards)


def reward(episode: GradedEpisode, shaping: RewardConfig = DEFAULT_REWARD,
           experiment: ExperimentConfig = DEFAULT_EXPERIMENT) -> float:
    """``shaping.resolved`` for a resolved episode, else ``shaping.unresolved``; with [reward.prm] enabled, plus
    ``prm.step_coef`` x the mean of the judge's step scores (rl/prm.py; nothing when no step was scored).
    Experiments: ``reward_requires_submit`` counts an episode that never submitted (TRUNCATED: the step limit or
    malformed replies ended it) as unresolved even when the diff it left behind resolves the task;
    ``truncated_reward`` (None: off) is what an unresolved episode that never submitted gets instead, so running out
    of steps can cost more than a wrong submission."""
    solved = episode.resolved and not (experiment.reward_requires_submit and episode.truncated)
    if solved:
        outcome = shaping.resolved
    elif experiment.truncated_reward is not None and episode.truncated:
        outcome = experiment.truncated_reward
    else:
        outcome = shaping.unresolved
    step_coef = shaping.prm.step_coef if shaping.prm.enabled else 0.0
    return outcome + process_bonus(episode.step_scores, step_coef) if step_coef else outcome


def score_group(group: Group, advantage: AdvantageConfig = DEFAULT_ADVANTAGE, shaping: RewardConfig = DEFAULT_REWARD,
                experiment: ExperimentConfig = DEFAULT_EXPERIMENT, *, shuffle_key: str = "") -> Group:
    """Fill in rewards (``reward``) and advantages (``advantage.estimator``). Experiments: ``zero_advantages`` is the
    control run (no learning signal); ``shuffle_rewards`` the shuffled-reward control run: the advantages come from
    the group's rewards in a random order seeded by ``shuffle_key``, so every update is as large as the real run's
    but not tied to what each episode did (``group.rewards`` keeps the true rewards, for the metrics);
    ``positive_advantages_only``: negative advantages become 0 (only the episodes better than their group's mean
    are reinforced); ``positive_advantage_scale``: positive advantages are multiplied by it (W-REINFORCE's lambda,
    Zhu et al. 2025: below 1 the update leans on pushing the failures down; 0 is negative-sample reinforcement
    alone)."""
    group.rewards = [reward(e, shaping, experiment) for e in group.episodes]
    scored = list(group.rewards)
    if experiment.shuffle_rewards:
        random.Random(f"shuffle:{shuffle_key}").shuffle(scored)
    advs = group_advantages(scored, advantage.estimator)
    if experiment.positive_advantages_only:
        advs = [max(a, 0.0) for a in advs]
    if experiment.positive_advantage_scale != 1.0:
        advs = [a * experiment.positive_advantage_scale if a > 0 else a for a in advs]
    group.advantages = [0.0] * len(advs) if experiment.zero_advantages else list(advs)
    return group


def first_format_error(episode: GradedEpisode) -> int | None:
    """The index of the episode's first malformed reply (an agent turn), or None."""
    return next(iter(malformed_turns(episode)), None)


def turn_spans(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """The trained spans of ``loss_mask`` (runs of non-zero entries: one agent turn's reply each) as
    ``(start, end)`` index pairs, in order."""
    spans: list[tuple[int, int]] = []
    start = None
    for i, value in enumerate([*loss_mask, 0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            spans.append((start, i))
            start = None
    return spans


def span_turns(loss_mask: Sequence[int], turns: Sequence[int] = ()) -> list[int]:
    """The turn number of each trained span of ``loss_mask``: ``turns`` (a gateway branch numbers its spans by the
    session's turns), or span i is turn i when it is empty. ValueError when ``turns`` does not number every span."""
    spans = len(turn_spans(loss_mask))
    if not turns:
        return list(range(spans))
    if len(turns) != spans:
        raise ValueError(f"{spans} trained spans but {len(turns)} turn numbers")
    return list(turns)


def mask_turns(loss_mask: Sequence[int], turns: Iterable[int]) -> list[int]:
    """``loss_mask`` with the trained spans numbered in ``turns`` (0-based agent turns) set to 0. ValueError when
    a turn has no span (the mask does not hold one span per turn)."""
    out = list(loss_mask)
    spans = turn_spans(loss_mask)
    for turn in turns:
        if not 0 <= turn < len(spans):
            raise ValueError(f"turn {turn} has no trained span (the loss mask holds {len(spans)})")
        start, end = spans[turn]
        out[start:end] = [0] * (end - start)
    return out


def malformed_turns(episode: GradedEpisode) -> list[int]:
    """The agent turns whose reply was malformed (no single bash block)."""
    return [i for i, bad in enumerate(episode.format_errors) if bad]


def masked_as_truncated(episode: GradedEpisode, endings: Iterable[str] = TRUNCATED_ENDINGS) -> bool:
    """Whether ``mask_truncated`` masks this episode: it is TRUNCATED and its exit status is one of ``endings``
    (an episode whose exit status is not known counts as any truncated one)."""
    return episode.truncated and (not episode.exit_status or episode.exit_status in set(endings))


def episode_samples(episode: GradedEpisode, advantage: float, reward_value: float, *, mode: SampleMode = "episode",
                    experiment: ExperimentConfig = DEFAULT_EXPERIMENT, loss: LossConfig = DEFAULT_LOSS
                    ) -> list[TrainSample]:
    """The training samples of one episode; the masks and weights below are the knobs of those names of ``loss``
    ([train.loss]: ``mask_truncated``, ``mask_truncated_endings`` as ``truncated_endings``, ``mask_format_errors``)
    and of ``experiment`` (``mask_after_format_error``; ``step_weight``: ``step_sample_weight``;
    ``step_score_coef``: ``step_score_advantage``). A truncated episode with ``mask_truncated`` keeps its tokens but no
    loss (mask all 0), so it still counts in nothing but the logs; ``truncated_endings`` says which exit statuses
    it masks (e.g. only the overlong ones, so an episode the malformed-reply limit ended still trains its
    well-formed turns with its advantage: with ``mask_format_errors`` too, masking that ending whole leaves it the
    one ending nothing pushes back on, and GRPO moves probability into it, learn_experiments.json session 6).

    With ``mask_after_format_error`` the turns after the episode's first malformed reply carry no loss: the
    malformed reply itself keeps a negative advantage (it is pushed down) and loses a positive one (a resolved
    episode that stumbled must not teach the stumble: seen in learn_experiments.json, where it was learnt), and what
    the policy wrote after it (off the path it was trained on, often degenerate) never reaches the gradient. With
    ``mask_format_errors`` the malformed replies themselves carry no loss, whatever the advantage's sign, and the
    turns around them train as usual: a resolved episode that recovered from a slip reinforces the recovery, not the
    slip, and a failed one does not push probability off a reply the protocol already rejects (pushing it down
    spreads probability: see learn_experiments.json, session 4).

    An external harness's episode (actors/harness.py) may hold more than one token sequence: the gateway session's
    branches (swectl/gateway/ledger.py). Each is its own sample with the episode's advantage, its spans numbered by
    the session's turns (so the masks above find the right turns), and every sampled token is in exactly one.

    Per-step samples (``mode = "step"``): every agent step is a sample trained on exactly the prompt the engine saw,
    with the episode's advantage, plus ``step_score_coef`` x that step's own judge score ([reward.prm]; 0 for a
    step without one). ``step_weight = "episode"`` divides each of an episode's k step samples' advantage by k, so
    an episode weighs the same however many steps it took (the policy loss is linear in the advantage, clipping
    aside, which depends only on its sign): with sequence-mean aggregation each episode counts once instead of k
    times; with token-mean a long episode's tokens count 1/k each."""
    uid = f"{episode.instance_id}#{episode.sample}"
    truncated = episode.truncated
    x = experiment
    keep = not (loss.mask_truncated and masked_as_truncated(episode, loss.mask_truncated_endings))
    cut = first_format_error(episode) if x.mask_after_format_error else None
    if cut is not None and advantage > 0:
        cut -= 1  # a malformed reply is never reinforced: with a positive advantage it is masked too
    common = {"advantage": advantage, "reward": reward_value, "weight_version": episode.weight_version,
              "truncated": truncated}
    malformed = set(malformed_turns(episode)) if loss.mask_format_errors else set()

    def trained(turn: int) -> bool:
        return keep and (cut is None or turn <= cut) and turn not in malformed

    if mode == "step" and episode.steps:
        out = []
        scale = 1.0 / len(episode.steps) if x.step_sample_weight == "episode" else 1.0
        scores = episode.step_scores
        for i, (prompt, output, logprobs) in enumerate(episode.steps):
            mask = [0] * len(prompt) + [1 if trained(i) else 0] * len(output)
            own = scores[i] if i < len(scores) and scores[i] is not None else 0.0
            fields = {**common, "advantage": (advantage + x.step_score_advantage * own) * scale}
            out.append(pack_sample(f"{uid}.{i}", episode.instance_id, [*prompt, *output], mask,
                                   [0.0] * len(prompt) + list(logprobs), **fields))
        return out
    streams = [TokenStream(token_ids=episode.token_ids, loss_mask=episode.loss_mask, logprobs=episode.logprobs,
                           turns=episode.turns), *episode.branches]
    out = []
    for k, stream in enumerate(streams):
        if not stream.token_ids:  # nothing was sampled (a harness refused at its first turn): nothing to train on
            continue
        try:
            numbers = span_turns(stream.loss_mask, stream.turns)
        except ValueError as exc:
            raise ValueError(f"{uid}: {exc}") from exc
        mask = mask_turns(stream.loss_mask, [i for i, turn in enumerate(numbers) if not trained(turn)])
        out.append(pack_sample(f"{uid}.b{k}" if k else uid, episode.instance_id, stream.token_ids, mask,
                               stream.logprobs, **common))
    return out


def group_samples(groups: Sequence[Group], *, mode: SampleMode = "episode",
                  experiment: ExperimentConfig = DEFAULT_EXPERIMENT, loss: LossConfig = DEFAULT_LOSS
                  ) -> list[TrainSample]:
    """Every group's training samples (``episode_samples`` per episode, with its advantage and reward)."""
    samples: list[TrainSample] = []
    for g in groups:
        for episode, adv, rew in zip(g.episodes, g.advantages, g.rewards, strict=True):
            samples += episode_samples(episode, adv, rew, mode=mode, experiment=experiment, loss=loss)
    return samples


def group_outcomes(groups: Sequence[Group]) -> dict[str, float]:
    """What the policy does over scored groups: mean reward and resolve rate per episode, pass@k, and how many
    episodes the grader graded ``tampered`` (``grade/tampered``)."""
    episodes = [e for g in groups for e in g.episodes]
    return {"reward_mean": sum(r for g in groups for r in g.rewards) / max(len(episodes), 1),
            "resolve_rate": sum(e.resolved for e in episodes) / max(len(episodes), 1),
            "pass_at_k": pass_at_k(groups), "grade/tampered": float(sum(e.tampered for e in episodes))}


def pass_at_k(groups: Sequence[Group]) -> float:
    """The fraction of groups with at least one resolved episode (pass@n of the group)."""
    if not groups:
        return 0.0
    return sum(any(e.resolved for e in g.episodes) for g in groups) / len(groups)
