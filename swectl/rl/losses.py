"""The trainer's losses as pure functions of tensors (TRAINING.md, "Policy loss"): no torch.distributed, no I/O.

Shapes: ``B`` sequences of ``T`` tokens (right-padded), vocabulary ``V``. Every per-token tensor is ``[B, T]``
and aligned with the tokens: position ``t`` holds the quantity of token ``t`` as predicted by the logits at
``t - 1``; position 0 (nothing predicts it) holds 0. ``mask`` is the loss mask (non-zero = trained on).

Aggregation and the denominator. Both options sum the per-token losses of the mask-1 tokens and divide by a
number the caller passes, computed over the *whole global batch* (every micro-batch on every rank):

- ``token_mean``: ``denominator`` = the number of mask-1 tokens of the global batch (DAPO's token-level mean);
- ``seq_mean_token_sum``: the per-sequence token sums, summed over sequences, ``denominator`` = the number of
  sequences of the global batch (with at least one mask-1 token).

Because the denominator is global, the micro-batch losses (and their gradients) simply add up: accumulating
over micro-batches and summing over ranks gives the whole batch's loss whatever the split. The two options
differ only in that denominator; the ``aggregation`` argument says which one the caller meant and sums in the
matching order.

Statistics come back as *sums* (and maxima) of detached 0-d float32 tensors, so the caller adds them over
micro-batches and all-reduces them over ranks (SUM, or MAX for the keys in ``MAX_STATS``), then divides by the
summed ``tokens``. Masked positions may hold anything (padding, stale logprobs, even inf or NaN): they are
replaced before any exponential, so they give exactly zero loss and zero gradient.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from swectl.errors import ConfigError

Aggregation = Literal["token_mean", "seq_mean_token_sum"]
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
MAX_STATS = ("ratio_max", "tis_max", "logprob_gap_max")  # statistics to reduce with MAX; every other key is a sum
CHUNK_ELEMENTS = 1 << 24  # logits elements per chunk (64 MiB of float32) in token_logprobs / token_entropy


# ---------------------------------------------------------------- per-token quantities from logits


def _next_tokens(tokens: Tensor) -> Tensor:
    """Row ``t`` holds token ``t + 1`` (the one the logits at ``t`` predict); the last column, predicting
    nothing, gets token 0 so every row has a valid index (its result is discarded)."""
    return F.pad(tokens[:, 1:], (0, 1), value=0)


def _align(per_position: Tensor) -> Tensor:
    """From "what the logits at t say" to "what token t got": shift right by one, position 0 gets 0."""
    return F.pad(per_position[:, :-1], (1, 0), value=0.0)


def _chunk_size(vocab: int, chunk_rows: int | None) -> int:
    """Rows per chunk: ``chunk_rows``, else as many as keep one float32 temporary near CHUNK_ELEMENTS."""
    return chunk_rows or max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _check_shapes(logits: Tensor, tokens: Tensor) -> None:
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ConfigError(f"token_logprobs: logits must be [B, T, V] and tokens [B, T]; got logits "
                          f"{tuple(logits.shape)} and tokens {tuple(tokens.shape)}")


def row_logprobs(rows: Tensor, targets: Tensor, *, chunk_rows: int | None = None) -> Tensor:
    """``[N]`` float32: the log-probability of ``targets[i]`` under the logits ``rows[i]`` (``[N, V]``).

    Computed as ``logit[target] - logsumexp(logits)`` per row, which equals ``log_softmax`` followed by a gather
    but never materialises a whole log-softmax (nor keeps one for backward): the temporaries are one chunk of
    ``chunk_rows`` rows (default: about CHUNK_ELEMENTS elements) at a time. Logits of another dtype are cast to
    float32 chunk by chunk. Differentiable with respect to ``rows``, also when N is 0 (a rank's empty micro-batch
    must still run backward through the model, for FSDP's collectives).
    """
    if rows.dim() != 2 or targets.shape != rows.shape[:1]:
        raise ConfigError(f"row_logprobs: logits must be [N, V] and targets [N]; got logits {tuple(rows.shape)} "
                          f"and targets {tuple(targets.shape)}")
    size = _chunk_size(rows.shape[1], chunk_rows)  # no shortcut for N = 0: the result stays in the graph
    parts = []
    for chunk, target in zip(rows.split(size), targets.long().reshape(-1, 1).split(size), strict=True):
        chunk = chunk.float()
        parts.append(chunk.gather(1, target).squeeze(1) - torch.logsumexp(chunk, dim=-1))
    return torch.cat(parts)


def row_entropy(rows: Tensor, *, chunk_rows: int | None = None) -> Tensor:
    """``[N]`` float32: the entropy of each row's distribution (``rows``: ``[N, V]`` logits), chunked like
    ``row_logprobs``; differentiable."""
    if rows.dim() != 2:
        raise ConfigError(f"row_entropy: logits must be [N, V]; got {tuple(rows.shape)}")
    parts = []
    for chunk in rows.split(_chunk_size(rows.shape[1], chunk_rows)):
        logp = torch.log_softmax(chunk.float(), dim=-1)
        parts.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(parts)


def token_logprobs(logits: Tensor, tokens: Tensor, *, chunk_rows: int | None = None) -> Tensor:
    """``[B, T]`` float32: the log-probability of ``tokens[:, t]`` under ``logits[:, t - 1]``; 0 at position 0.

    ``row_logprobs`` over the full-length rows (no ``logits[:, :-1]`` slice, which would copy when B > 1); the
    last position's result is dropped. Differentiable with respect to ``logits``.
    """
    _check_shapes(logits, tokens)
    batch, length, vocab = logits.shape
    if length == 0:
        return logits.new_zeros((batch, 0), dtype=torch.float32)
    rows = logits.reshape(batch * length, vocab)
    targets = _next_tokens(tokens.long()).reshape(batch * length)
    return _align(row_logprobs(rows, targets, chunk_rows=chunk_rows).reshape(batch, length))


def token_entropy(logits: Tensor, *, chunk_rows: int | None = None) -> Tensor:
    """``[B, T]`` float32: the entropy of the distribution that predicted token ``t`` (``logits[:, t - 1]``),
    0 at position 0; aligned like ``token_logprobs``. Chunked the same way; differentiable."""
    if logits.dim() != 3:
        raise ConfigError(f"token_entropy: logits must be [B, T, V]; got {tuple(logits.shape)}")
    batch, length, vocab = logits.shape
    if length == 0:
        return logits.new_zeros((batch, 0), dtype=torch.float32)
    return _align(row_entropy(logits.reshape(batch * length, vocab), chunk_rows=chunk_rows).reshape(batch, length))


# ---------------------------------------------------------------- only the positions the loss reads


def predicting_positions(mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(rows, cols)``: where the logits that predict the mask-1 tokens sit. Token ``(b, t)`` is predicted by
    the logits at ``(b, t - 1)``; a mask-1 token at position 0 has no predictor and is left out (its
    per-token quantities are 0, as in ``token_logprobs``). Row-major order, the order ``spread`` expects."""
    if mask.dim() != 2:
        raise ConfigError(f"predicting_positions: mask must be [B, T]; got {tuple(mask.shape)}")
    keep = mask != 0
    keep[:, 0] = False
    rows, cols = keep.nonzero(as_tuple=True)
    return rows, cols - 1


def targets_at(tokens: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """``[N]``: the tokens that the logits at ``(rows, cols)`` predict (``tokens[rows, cols + 1]``)."""
    return tokens[rows, cols + 1]


def spread(values: Tensor, rows: Tensor, cols: Tensor, shape: torch.Size | tuple[int, int]) -> Tensor:
    """``[B, T]`` float32, aligned like ``token_logprobs``: ``values[i]`` (computed from the logits at
    ``(rows[i], cols[i])``) lands on the token it predicts, ``(rows[i], cols[i] + 1)``; every other position
    holds 0. Differentiable with respect to ``values``."""
    out = values.new_zeros(tuple(shape), dtype=torch.float32)
    return out.index_put((rows, cols + 1), values.float())


# ---------------------------------------------------------------- aggregation


def _check_aggregation(aggregation: str, denominator: float) -> None:
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"unknown loss aggregation {aggregation!r}; expected one of {', '.join(AGGREGATIONS)}")
    if not denominator > 0:
        raise ConfigError(f"loss denominator must be > 0 (the global batch's mask-1 tokens for token_mean, its "
                          f"sequences for seq_mean_token_sum); got {denominator!r}")


def _aggregate(per_token: Tensor, aggregation: Aggregation, denominator: float) -> Tensor:
    """The micro-batch's share of the global loss. ``per_token`` is already 0 at masked positions."""
    if aggregation == "seq_mean_token_sum":
        return per_token.sum(dim=-1).sum() / denominator
    return per_token.sum() / denominator


def _keep(mask: Tensor) -> Tensor:
    return mask != 0


def _masked(keep: Tensor, values: Tensor, fill: float = 0.0) -> Tensor:
    """``values`` where ``keep``, else ``fill``: masked positions never reach exp() or the loss, and get no
    gradient (even if they hold inf or NaN)."""
    return torch.where(keep, values, torch.full_like(values, fill))


def _masked_max(keep: Tensor, values: Tensor) -> Tensor:
    """The largest of ``values`` where ``keep`` (0 when nothing is kept: every quantity maxed here is >= 0)."""
    return _masked(keep, values).max() if values.numel() else values.new_zeros(())


# ---------------------------------------------------------------- the losses


def low_var_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token low-variance KL estimate of KL(pi || ref) from sampled tokens: ``exp(ref - pi) - (ref - pi) - 1``
    (the "k3" estimator; always >= 0, zero where the logprobs agree). Elementwise, no masking."""
    diff = ref_logp - logp
    return torch.exp(diff) - diff - 1.0


def _clip_surrogate(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """``-min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)`` per token (DAPO's clip-higher)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    return -torch.minimum(unclipped, clipped)


def _tis_weight(keep: Tensor, old_logp: Tensor, rollout_logp: Tensor, cap: float | None) -> tuple[Tensor, Tensor]:
    """The raw importance ratio ``exp(old - rollout)`` (1 at masked positions) and the weight applied to the loss:
    ``min(raw, cap)``, or 1 everywhere when ``cap`` is None. Both detached: the weight is a constant."""
    with torch.no_grad():
        raw = torch.exp(_masked(keep, old_logp.detach() - rollout_logp.detach()))
        weight = torch.ones_like(raw) if cap is None else raw.clamp(max=cap)
    return raw, weight


def policy_loss(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                denominator: float, aggregation: Aggregation = "token_mean", eps_low: float = 0.2,
                eps_high: float = 0.28, tis_cap: float | None = 2.0, ref_logp: Tensor | None = None,
                kl_coef: float = 0.0, prob_weight: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped policy-gradient loss of one micro-batch, as its share of the global batch's loss.

    All tensors are ``[B, T]``: ``logp`` the policy being trained (with gradient), ``old_logp`` the policy at the
    start of the step, ``rollout_logp`` the engine that sampled, ``advantages`` the episode's advantage on each
    token, ``mask`` the loss mask. Per mask-1 token::

        ratio = exp(logp - old_logp)
        L     = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)
        w     = min(exp(old_logp - rollout_logp), tis_cap)     (constant; 1 when tis_cap is None)
        loss  = w * L + kl_coef * low_var_kl(logp, ref_logp)   (the KL term only when ref_logp is given)

    With ``prob_weight`` = alpha > 0, each token's advantage is first scaled by the constant
    ``alpha * exp(old_logp) + (1 - alpha)`` (advantage reweighting, Yang et al. 2025, "Do Not Let Low-Probability
    Tokens Over-Dominate in RL for LLMs"): a sampled token's log-probability gradient grows as its probability
    falls, so a few unlikely tokens (a slip the episode survived, the text after one it did not) otherwise carry
    most of the update; 0 (the default) leaves the advantages as they are.

    summed and divided by ``denominator`` (see the module docstring for ``aggregation``). The gradient of an
    unclipped token's surrogate with respect to its logp is ``-w * A * ratio``; a clipped one has none.

    The statistics, all sums over the micro-batch's mask-1 tokens unless said otherwise (detached 0-d float32):

    - ``tokens``: the number of mask-1 tokens;
    - ``loss_sum``: the per-token losses (``w * L`` plus the KL term) before division by the denominator;
    - ``clipped_low``: tokens whose gradient the lower clip removed (``A < 0`` and ``ratio < 1 - eps_low``);
    - ``clipped_high``: tokens whose gradient the upper clip removed (``A > 0`` and ``ratio > 1 + eps_high``);
    - ``ratio_sum``: the policy ratios ``exp(logp - old_logp)``; ``ratio_max`` their maximum (reduce with MAX);
    - ``tis_sum``: the raw (uncapped) importance ratios ``exp(old_logp - rollout_logp)``, computed even when
      ``tis_cap`` is None, to watch the engine/trainer mismatch; ``tis_max`` their maximum (reduce with MAX);
    - ``tis_clipped``: tokens whose raw importance ratio exceeded ``tis_cap`` (0 when it is None);
    - ``logprob_gap_max``: the largest ``|old_logp - rollout_logp|`` (reduce with MAX): on policy (the trainer's
      weights are the ones that sampled) this is how far the trainer's logprobs are from the engine's;
    - ``kl_sum``: the low-variance KL to the reference, unscaled by ``kl_coef`` (0 when ``ref_logp`` is None).

    Maxima are 0 for a micro-batch without mask-1 tokens (every ratio is positive, so 0 never wins a MAX).
    """
    _check_aggregation(aggregation, denominator)
    keep = _keep(mask)
    if not 0.0 <= prob_weight <= 1.0:
        raise ValueError(f"prob_weight must be in [0, 1], got {prob_weight}")
    ratio = torch.exp(_masked(keep, logp - old_logp))
    advantages = _masked(keep, advantages)
    if prob_weight:
        with torch.no_grad():
            scale = prob_weight * torch.exp(_masked(keep, old_logp.detach(), fill=-math.inf)) + (1.0 - prob_weight)
        advantages = advantages * scale
    surrogate = _clip_surrogate(ratio, advantages, eps_low, eps_high)
    raw_tis, weight = _tis_weight(keep, old_logp, rollout_logp, tis_cap)
    per_token = weight * surrogate
    kl = torch.zeros_like(per_token)
    if ref_logp is not None:
        kl = _masked(keep, low_var_kl(_masked(keep, logp), _masked(keep, ref_logp)))
        per_token = per_token + kl_coef * kl
    per_token = _masked(keep, per_token)
    loss = _aggregate(per_token, aggregation, denominator)
    with torch.no_grad():
        ratio_d = ratio.detach()
        stats = {
            "tokens": keep.sum(),
            "loss_sum": per_token.detach().sum(),
            "clipped_low": (keep & (advantages < 0) & (ratio_d < 1.0 - eps_low)).sum(),
            "clipped_high": (keep & (advantages > 0) & (ratio_d > 1.0 + eps_high)).sum(),
            "ratio_sum": _masked(keep, ratio_d).sum(),
            "ratio_max": _masked_max(keep, ratio_d),
            "tis_sum": _masked(keep, raw_tis).sum(),
            "tis_max": _masked_max(keep, raw_tis),
            "tis_clipped": (keep & (raw_tis > (math.inf if tis_cap is None else tis_cap))).sum(),
            "logprob_gap_max": _masked_max(keep, (old_logp.detach() - rollout_logp.detach()).abs()),
            "kl_sum": kl.detach().sum(),
        }
    return loss, {key: value.float() for key, value in stats.items()}


def sft_loss(logp: Tensor, mask: Tensor, *, denominator: float, aggregation: Aggregation = "token_mean"
             ) -> tuple[Tensor, dict[str, Tensor]]:
    """Cross-entropy ``-logp`` on the mask-1 tokens, summed and divided by ``denominator`` like ``policy_loss``.

    Statistics (sums over the micro-batch's mask-1 tokens, detached 0-d float32): ``tokens`` (their number) and
    ``loss_sum`` (their negative log-likelihoods before division by the denominator).
    """
    _check_aggregation(aggregation, denominator)
    keep = _keep(mask)
    per_token = _masked(keep, -logp)
    loss = _aggregate(per_token, aggregation, denominator)
    stats = {"tokens": keep.sum(), "loss_sum": per_token.detach().sum()}
    return loss, {key: value.float() for key, value in stats.items()}
