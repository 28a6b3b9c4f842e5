"""Offline probe of one policy-update rule: how do its first steps move held-out episodes' log-probabilities?

A GRPO run costs minutes per step on this CPU machine and a sampled evaluation is noisy (72 episodes: about +-6
points), so telling a bad update rule from bad luck takes hours. This probe answers a narrower question in
minutes. It takes episodes the starting policy sampled (a `swectl eval` folder and/or a control run's
``episodes/``, where the weights never change), splits each task's episodes in two, and takes a few optimizer steps
on groups drawn from one half, with swectl's own advantage and loss functions. After every step it reports the
change of the total log-probability of the other half's resolved (and cleanly submitted) episodes, of its failed
ones, and of the gold trajectories. A rule that helps raises (or keeps) the successes and lowers the failures; a
rule whose steps lower the successes by nats will lower the sampled resolve rate, whatever its loss says.

    python experiments/probe_update.py --weights RUN/sft/weights/step_000200 --episodes RUN/eval-sft \\
        --episodes 'RUN/control/episodes/step_*' --gold RUN/gold --mask first --requires-submit --lr 2e-4

``--compare-gold`` also reports, for each step's batch before the update, the cosine between its policy gradient
and the gradient of SFT on the gold trajectories (the direction that is known to raise the sampled rate), for the
batch as masked and with each failed episode also masked after its first slip (the first trained token the
engine sampled with probability below ``--slip-p``), and the share of the batch's gradient norm that comes from
those post-slip tokens.

Masks: ``none`` (every reply trained), ``truncated`` (truncated episodes carry no loss, as train.loss.mask_truncated),
``first`` (nothing after an episode's first malformed reply, as experiment.mask_after_format_error); ``--positive-only``
drops every sample whose advantage is not positive. It runs in one process on the CPU, without the trainer's
FSDP workers: the loss, advantages and masks are the trainer's, the optimizer is a plain AdamW (or SGD), and every
sample is treated as on-policy (the old log-probabilities are the current ones).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import random
import sys
from pathlib import Path

import msgspec
import torch
from transformers import AutoModelForCausalLM

from swectl.actors.rollout import EpisodeResult
from swectl.config import ExperimentConfig, LossConfig
from swectl.rl.advantages import group_advantages
from swectl.rl.batch import unpack_mask
from swectl.rl.groups import GradedEpisode, episode_samples
from swectl.rl.losses import policy_loss, sft_loss, token_logprobs
from swectl.train.rollouts import read_graded_episode


class Probed(msgspec.Struct):
    episode: GradedEpisode
    submitted: bool


def load_episodes(patterns: list[str]) -> list[Probed]:
    """The episode folders (``meta.json`` + ``traj.json``) under ``patterns``, read as the trainer reads them."""
    out = []
    for pattern in patterns:
        for meta_path in sorted(glob.glob(str(Path(pattern) / "*" / "meta.json"))):
            result = msgspec.json.decode(Path(meta_path).read_bytes(), type=EpisodeResult)
            result = msgspec.structs.replace(result, artifacts=str(Path(meta_path).parent))
            out.append(Probed(read_graded_episode(result), submitted=result.exit_status == "Submitted"))
    return out


def _tensors(episodes: list[GradedEpisode], masks: list[list[int]]) -> tuple[torch.Tensor, ...]:
    width = max(len(e.token_ids) for e in episodes)
    ids = torch.zeros(len(episodes), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros(len(episodes), width)
    rollout = torch.zeros(len(episodes), width)
    for row, (e, m) in enumerate(zip(episodes, masks, strict=True)):
        n = len(e.token_ids)
        ids[row, :n] = torch.tensor(e.token_ids)
        attention[row, :n] = 1
        mask[row, :n] = torch.tensor(m, dtype=torch.float32)
        rollout[row, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
    return ids, attention, mask, rollout


def _forward(model, episodes: list[GradedEpisode], masks: list[list[int]]) -> tuple[torch.Tensor, ...]:
    """One forward pass over ``episodes``: their token log-probabilities, loss masks and rollout log-probabilities
    (``[B, T]`` each)."""
    ids, attention, mask, rollout = _tensors(episodes, masks)
    return token_logprobs(model(input_ids=ids, attention_mask=attention).logits.float(), ids), mask, rollout


@torch.no_grad()
def total_logprobs(model, episodes: list[GradedEpisode], chunk: int = 8) -> list[float]:
    model.eval()
    out: list[float] = []
    for i in range(0, len(episodes), chunk):
        part = episodes[i:i + chunk]
        logp, mask, _ = _forward(model, part, [e.loss_mask for e in part])
        out += (logp * mask).sum(-1).tolist()
    return out


def flat_grad(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


CHUNK = 4  # episodes per forward/backward pass: a batch's logits at once (vocabulary x tokens) overflow memory


def gold_gradient(model, gold: list[GradedEpisode]) -> torch.Tensor:
    """The gradient of SFT's loss on the gold trajectories (their loss masks), flattened."""
    model.train()
    model.zero_grad()
    denominator = float(sum(map(sum, (e.loss_mask for e in gold)))) or 1.0
    for i in range(0, len(gold), CHUNK):
        part = gold[i:i + CHUNK]
        logp, mask, _ = _forward(model, part, [e.loss_mask for e in part])
        sft_loss(logp, mask, denominator=denominator)[0].backward()
    out = flat_grad(model)
    model.zero_grad()
    return out


def after_first_slip(mask: list[int], rollout_logp: list[float], slip_logp: float) -> list[int]:
    """``mask`` with every trained token after the first trained token sampled below ``slip_logp`` set to 0."""
    out = list(mask)
    slipped = False
    for i, (m, lp) in enumerate(zip(mask, rollout_logp, strict=True)):
        if slipped:
            out[i] = 0
        elif m and lp < slip_logp:
            slipped = True
    return out


def batch_gradient(model, batch: list[GradedEpisode], masks: list[list[int]], advantages: list[float],
                   denominator: float, prob_weight: float = 0.0) -> torch.Tensor:
    """The policy gradient of ``batch`` (flattened); one ``denominator`` for every mask compared, so that the
    difference of two masks' gradients is the gradient of the tokens between them."""
    model.zero_grad()
    accumulate_policy_gradient(model, batch, masks, advantages, denominator, prob_weight)
    out = flat_grad(model)
    model.zero_grad()
    return out


def accumulate_policy_gradient(model, batch: list[GradedEpisode], masks: list[list[int]], advantages: list[float],
                               denominator: float, prob_weight: float) -> float:
    """Add the policy loss's gradient over ``batch`` to the parameters' ``.grad``, ``CHUNK`` episodes per pass
    (the loss is a sum over tokens divided by one ``denominator``, so the passes add up to the whole batch's).
    Returns the loss."""
    model.train()
    total = 0.0
    for i in range(0, len(batch), CHUNK):
        if not any(map(any, masks[i:i + CHUNK])):
            continue
        logp, mask, rollout = _forward(model, batch[i:i + CHUNK], masks[i:i + CHUNK])
        adv = torch.tensor(advantages[i:i + CHUNK])[:, None].expand_as(logp)
        loss, _ = policy_loss(logp, logp.detach(), rollout, adv, mask, denominator=denominator,
                              prob_weight=prob_weight)
        loss.backward()
        total += float(loss.detach())
    return total


def train_mask(e: GradedEpisode, advantage: float, args: argparse.Namespace) -> list[int]:
    """The loss mask the trainer would use (train.loss.mask_truncated / experiment.mask_after_format_error), or all
    0 for a sample ``--positive-only`` drops."""
    if args.positive_only and advantage <= 0:
        return [0] * len(e.loss_mask)
    experiment = ExperimentConfig(mask_after_format_error=args.mask == "first")
    sample, = episode_samples(e, advantage, 0.0, experiment=experiment,
                              loss=LossConfig(mask_truncated=args.mask == "truncated"))
    return unpack_mask(sample).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=Path, required=True, help="the starting policy (an HF folder)")
    parser.add_argument("--episodes", action="append", required=True,
                        help="folder (glob) of episode folders sampled from --weights (repeatable)")
    parser.add_argument("--gold", default="", help="folder of gold trajectories (swectl data gold)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--n-samples", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--estimator", choices=("grpo", "drgrpo", "rloo"), default="grpo")
    parser.add_argument("--mask", choices=("none", "truncated", "first"), default="none")
    parser.add_argument("--positive-only", action="store_true")
    parser.add_argument("--prob-weight", type=float, default=0.0,
                        help="advantage reweighting alpha (experiment.prob_weight): advantages times "
                             "alpha * p + 1 - alpha")
    parser.add_argument("--requires-submit", action="store_true", help="as experiment.reward_requires_submit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare-gold", action="store_true",
                        help="report each batch gradient's cosine with the gold SFT gradient (needs --gold)")
    parser.add_argument("--slip-p", type=float, default=0.1,
                        help="--compare-gold: a sampled token below this probability is a slip")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    episodes = load_episodes(args.episodes)
    gold = [p.episode for p in load_episodes([args.gold])] if args.gold else []
    by_task: dict[str, list[Probed]] = {}
    for p in episodes:
        by_task.setdefault(p.episode.instance_id, []).append(p)
    pool: dict[str, list[GradedEpisode]] = {}
    held: list[Probed] = []
    for task, items in sorted(by_task.items()):
        rng.shuffle(items)
        half = len(items) // 2
        held += items[:half]
        pool[task] = [p.episode for p in items[half:]]
    tasks = sorted(t for t, v in pool.items() if v)
    if not tasks or not held:
        raise SystemExit("probe_update: too few episodes (need at least two per task)")
    print(f"probe: {len(episodes)} episodes of {len(tasks)} tasks ({len(held)} held out), {len(gold)} gold",
          file=sys.stderr)

    model = AutoModelForCausalLM.from_pretrained(args.weights, dtype=torch.float32)
    if args.optimizer == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    held_eps = [p.episode for p in held]
    base, gold_base = total_logprobs(model, held_eps), total_logprobs(model, gold)
    good = [i for i, p in enumerate(held) if p.episode.resolved and p.submitted]
    bad = [i for i, p in enumerate(held) if not p.episode.resolved]
    for step in range(1, args.steps + 1):
        batch, masks, advantages = [], [], []
        for task in rng.sample(tasks, min(args.tasks_per_step, len(tasks))):
            group = [rng.choice(pool[task]) for _ in range(args.n_samples)]
            rewards = [float(e.resolved and not (args.requires_submit and e.truncated)) for e in group]
            for e, adv in zip(group, group_advantages(rewards, args.estimator), strict=True):
                batch.append(e)
                masks.append(train_mask(e, adv, args))
                advantages.append(adv)
        trained = sum(map(sum, masks))
        compared: dict[str, float] = {}
        if args.compare_gold and gold:
            g_gold = gold_gradient(model, gold)
            denominator = float(max(1, trained))
            g_batch = batch_gradient(model, batch, masks, advantages, denominator, args.prob_weight)
            slip_masks = [after_first_slip(m, e.logprobs, math.log(args.slip_p)) if a < 0 else m
                          for e, m, a in zip(batch, masks, advantages, strict=True)]
            g_slip = batch_gradient(model, batch, slip_masks, advantages, denominator, args.prob_weight)
            cos = torch.nn.functional.cosine_similarity
            compared = {"cos_gold": round(float(cos(g_batch, g_gold, dim=0)), 4),
                        "cos_gold_slip_masked": round(float(cos(g_slip, g_gold, dim=0)), 4),
                        "post_slip_share_of_norm": round(float((g_batch - g_slip).norm() / g_batch.norm()), 3)
                        if g_batch.norm() > 0 else 0.0,
                        "post_slip_tokens": int(trained - sum(map(sum, slip_masks)))}
        loss_value, grad_norm = 0.0, 0.0
        if trained > 0:
            optimizer.zero_grad()
            loss_value = accumulate_policy_gradient(model, batch, masks, advantages, float(trained), args.prob_weight)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            optimizer.step()
        now, gold_now = total_logprobs(model, held_eps), total_logprobs(model, gold)

        def mean_change(rows: list[int], a: list[float] = now, b: list[float] = base) -> float:
            return sum(a[i] - b[i] for i in rows) / len(rows) if rows else float("nan")

        row = {"step": step, "loss": round(loss_value, 4), "grad_norm": round(grad_norm, 4),
               "trained_tokens": int(trained), "d_logp_resolved": round(mean_change(good), 2),
               "d_logp_failed": round(mean_change(bad), 2),
               "d_logp_gold": round(mean_change(list(range(len(gold))), gold_now, gold_base), 2),
               "d_logp_gold_min": round(min((x - y for x, y in zip(gold_now, gold_base, strict=True)),
                                            default=float("nan")), 2), **compared}
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
