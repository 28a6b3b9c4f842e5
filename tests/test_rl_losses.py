"""The trainer's losses: token logprobs against a naive loop, every clip case by hand, gradients, the TIS weight,
masks, the KL term, and the key invariant: micro-batches and ranks with the global denominator add up to the
whole batch's loss and gradients, for both aggregations."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch

from swectl.errors import ConfigError
from swectl.rl.losses import (
    MAX_STATS,
    low_var_kl,
    policy_loss,
    predicting_positions,
    row_entropy,
    row_logprobs,
    sft_loss,
    spread,
    targets_at,
    token_entropy,
    token_logprobs,
)

torch.set_num_threads(1)

EPS_LOW, EPS_HIGH = 0.2, 0.28


def rows(*values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def one_token(ratio: float, adv: float, *, rollout_ratio: float = 1.0, tis_cap: float | None = None,
              ref: float | None = None, kl_coef: float = 0.0) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """policy_loss of a single token with old_logp 0 and the given ratio; returns loss, stats, d loss / d logp.
    ``rollout_ratio`` is exp(old - rollout), the raw TIS ratio."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    old = torch.zeros(1, 1)
    rollout = torch.tensor([[-math.log(rollout_ratio)]])
    ref_logp = None if ref is None else torch.tensor([[ref]])
    loss, stats = policy_loss(logp, old, rollout, torch.tensor([[adv]]), torch.ones(1, 1), denominator=1.0,
                              eps_low=EPS_LOW, eps_high=EPS_HIGH, tis_cap=tis_cap, ref_logp=ref_logp,
                              kl_coef=kl_coef)
    loss.backward()
    assert logp.grad is not None
    return loss.detach(), stats, logp.grad[0, 0]


# ---------------------------------------------------------------- token_logprobs / token_entropy


def naive_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(tokens.shape)
    for b in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            out[b, t] = torch.log_softmax(logits[b, t - 1].double(), -1)[tokens[b, t]].float()
    return out


def naive_entropy(logits: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(logits.shape[:2])
    for b in range(logits.shape[0]):
        for t in range(1, logits.shape[1]):
            p = torch.softmax(logits[b, t - 1].double(), -1)
            out[b, t] = -(p * p.log()).sum().float()
    return out


def random_logits(batch: int = 3, length: int = 6, vocab: int = 11, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=gen) * 3
    tokens = torch.randint(0, vocab, (batch, length), generator=gen)
    return logits, tokens


@pytest.mark.parametrize("chunk_rows", [None, 1, 4, 7, 1000])
def test_token_logprobs_matches_a_naive_loop(chunk_rows: int | None) -> None:
    logits, tokens = random_logits()
    got = token_logprobs(logits, tokens, chunk_rows=chunk_rows)
    assert got.dtype == torch.float32 and got.shape == tokens.shape
    assert torch.equal(got[:, 0], torch.zeros(3))
    torch.testing.assert_close(got, naive_logprobs(logits, tokens), atol=1e-5, rtol=1e-5)


def test_token_logprobs_gradient_matches_log_softmax_gather() -> None:
    logits, tokens = random_logits(seed=1)
    weights = torch.randn(tokens.shape)
    mine = logits.clone().requires_grad_()
    (token_logprobs(mine, tokens, chunk_rows=5) * weights).sum().backward()
    ref = logits.clone().requires_grad_()
    picked = torch.log_softmax(ref[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    (picked * weights[:, 1:]).sum().backward()
    torch.testing.assert_close(mine.grad, ref.grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(mine.grad[:, -1], torch.zeros_like(mine.grad[:, -1]))  # the last logits predict nothing


def test_token_logprobs_of_bfloat16_logits_are_float32() -> None:
    logits, tokens = random_logits(seed=2)
    half = logits.bfloat16()
    got = token_logprobs(half, tokens)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, naive_logprobs(half.float(), tokens), atol=1e-5, rtol=1e-5)


def test_token_logprobs_saves_no_vocabulary_sized_tensor_for_backward() -> None:
    """Only the logits themselves (by reference) may be kept for backward: no log_softmax copy."""
    batch, length, vocab = 2, 16, 50
    logits = torch.randn(batch, length, vocab, requires_grad=True)
    tokens = torch.randint(0, vocab, (batch, length))
    big: list[int] = []

    def pack(saved: torch.Tensor) -> torch.Tensor:
        if saved.numel() >= batch * length * vocab // 4 and saved.untyped_storage().data_ptr() != \
                logits.untyped_storage().data_ptr():
            big.append(saved.numel())
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        token_logprobs(logits, tokens, chunk_rows=8).sum().backward()
    assert big == []


def test_token_logprobs_short_sequences() -> None:
    logits, tokens = random_logits(length=1)
    assert torch.equal(token_logprobs(logits, tokens), torch.zeros(3, 1))
    empty = token_logprobs(torch.zeros(2, 0, 5), torch.zeros(2, 0, dtype=torch.long))
    assert empty.shape == (2, 0)


def test_token_logprobs_checks_shapes() -> None:
    with pytest.raises(ConfigError, match=r"logits must be \[B, T, V\]"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("chunk_rows", [None, 2, 5])
def test_token_entropy_matches_a_naive_loop(chunk_rows: int | None) -> None:
    logits, _ = random_logits(seed=3)
    got = token_entropy(logits, chunk_rows=chunk_rows)
    assert got.dtype == torch.float32 and got.shape == logits.shape[:2]
    assert torch.equal(got[:, 0], torch.zeros(3))
    torch.testing.assert_close(got, naive_entropy(logits), atol=1e-5, rtol=1e-5)


def test_selected_positions_give_token_logprobs_and_entropy_at_the_mask() -> None:
    """The trainer's selected-logits path: the logits at predicting_positions, scored with row_logprobs /
    row_entropy and spread back, equal token_logprobs / token_entropy wherever the mask is 1 and are 0 elsewhere
    (a mask-1 token at position 0 has no predictor: 0, as token_logprobs gives)."""
    logits, tokens = random_logits(seed=5)
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 1]], dtype=torch.float32)
    rows_, cols = predicting_positions(mask)
    assert rows_.tolist() == [0, 0, 2, 2, 2] and cols.tolist() == [1, 2, 0, 1, 4]
    assert targets_at(tokens, rows_, cols).tolist() == [tokens[0, 2], tokens[0, 3], tokens[2, 1], tokens[2, 2],
                                                         tokens[2, 5]]
    chosen = logits[rows_, cols].clone().requires_grad_(True)
    logp = spread(row_logprobs(chosen, targets_at(tokens, rows_, cols), chunk_rows=2), rows_, cols, mask.shape)
    entropy = spread(row_entropy(chosen.detach(), chunk_rows=3), rows_, cols, mask.shape)
    torch.testing.assert_close(logp, token_logprobs(logits, tokens) * mask, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(entropy, token_entropy(logits) * mask, atol=1e-6, rtol=1e-6)
    full = logits.clone().requires_grad_(True)
    (token_logprobs(full, tokens) * mask).sum().backward()
    logp.sum().backward()
    assert chosen.grad is not None and full.grad is not None
    torch.testing.assert_close(chosen.grad, full.grad[rows_, cols])


def test_selected_positions_of_an_empty_mask_and_bad_shapes() -> None:
    rows_, cols = predicting_positions(torch.zeros(2, 4))
    assert rows_.numel() == 0
    nothing = torch.zeros(0, 11, requires_grad=True)
    logp = spread(row_logprobs(nothing, torch.zeros(0, dtype=torch.long)), rows_, cols, (2, 4))
    assert torch.equal(logp, torch.zeros(2, 4)) and row_entropy(nothing).shape == (0,)
    logp.sum().backward()
    for call in (lambda: row_logprobs(torch.zeros(3, 5), torch.zeros(2, dtype=torch.long)),
                 lambda: row_entropy(torch.zeros(3)), lambda: predicting_positions(torch.zeros(4))):
        with pytest.raises(ConfigError):
            call()


def test_token_entropy_of_uniform_and_certain_distributions() -> None:
    logits = torch.zeros(1, 3, 8)
    logits[0, 1] = torch.tensor([100.0] + [0.0] * 7)  # all but certain: predicts token 2
    got = token_entropy(logits)
    assert got[0, 0] == 0.0
    assert got[0, 1].item() == pytest.approx(math.log(8))
    assert got[0, 2].item() == pytest.approx(0.0, abs=1e-6)


# ---------------------------------------------------------------- the clipped surrogate, token by token

CASES = {
    # name: (ratio, A, loss, d loss / d logp, clipped_low, clipped_high)
    "A>0 above 1+eps_high: clipped": (1.5, 1.0, -1.28, 0.0, 0, 1),
    "A>0 inside": (1.1, 1.0, -1.1, -1.1, 0, 0),
    "A>0 in clip-higher room (1.2 < r < 1.28)": (1.25, 1.0, -1.25, -1.25, 0, 0),
    "A>0 below 1-eps_low: not clipped": (0.5, 1.0, -0.5, -0.5, 0, 0),
    "A<0 below 1-eps_low: clipped": (0.5, -1.0, 0.8, 0.0, 1, 0),
    "A<0 inside": (0.9, -2.0, 1.8, 1.8, 0, 0),
    "A<0 above 1+eps_high: not clipped": (1.5, -1.0, 1.5, 1.5, 0, 0),
    "A=0": (1.5, 0.0, 0.0, 0.0, 0, 0),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_clip_cases(case: str) -> None:
    ratio, adv, want_loss, want_grad, low, high = CASES[case]
    loss, stats, grad = one_token(ratio, adv)
    assert loss.item() == pytest.approx(want_loss, abs=1e-6)
    assert grad.item() == pytest.approx(want_grad, abs=1e-6)
    if want_grad:
        assert grad.item() == pytest.approx(-adv * ratio, abs=1e-6)  # unclipped: -w * A * ratio with w = 1
    assert stats["clipped_low"].item() == low
    assert stats["clipped_high"].item() == high
    assert stats["ratio_sum"].item() == pytest.approx(ratio)
    assert stats["ratio_max"].item() == pytest.approx(ratio)
    assert stats["loss_sum"].item() == pytest.approx(want_loss, abs=1e-6)
    assert stats["tokens"].item() == 1


def test_tis_weight_scales_loss_and_gradient() -> None:
    loss, stats, grad = one_token(1.1, 2.0, rollout_ratio=1.5, tis_cap=2.0)
    assert loss.item() == pytest.approx(-1.5 * 2.0 * 1.1)
    assert grad.item() == pytest.approx(-1.5 * 2.0 * 1.1)  # -w * A * ratio
    assert stats["tis_sum"].item() == pytest.approx(1.5)
    assert stats["tis_max"].item() == pytest.approx(1.5)
    assert stats["tis_clipped"].item() == 0


def test_tis_weight_is_capped() -> None:
    loss, stats, grad = one_token(1.1, 2.0, rollout_ratio=3.0, tis_cap=2.0)
    assert loss.item() == pytest.approx(-2.0 * 2.0 * 1.1)
    assert grad.item() == pytest.approx(-2.0 * 2.0 * 1.1)
    assert stats["tis_sum"].item() == pytest.approx(3.0)  # the raw ratio, to watch the mismatch
    assert stats["tis_max"].item() == pytest.approx(3.0)
    assert stats["tis_clipped"].item() == 1
    assert stats["logprob_gap_max"].item() == pytest.approx(math.log(3.0))  # |old - rollout|


def test_tis_weight_on_a_clipped_token_leaves_no_gradient() -> None:
    loss, _, grad = one_token(1.5, 1.0, rollout_ratio=1.5, tis_cap=2.0)
    assert loss.item() == pytest.approx(-1.5 * 1.28)
    assert grad.item() == 0.0


def test_tis_off_when_cap_is_none_but_still_reported() -> None:
    loss, stats, grad = one_token(1.1, 2.0, rollout_ratio=3.0, tis_cap=None)
    assert loss.item() == pytest.approx(-2.0 * 1.1)
    assert grad.item() == pytest.approx(-2.0 * 1.1)
    assert stats["tis_sum"].item() == pytest.approx(3.0)
    assert stats["tis_clipped"].item() == 0


def test_tis_weight_is_detached() -> None:
    """No gradient flows into the rollout logprobs, and old_logp gets gradient only through the ratio."""
    logp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.6, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-1.5, -0.4, -3.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 0.5]])
    loss, _ = policy_loss(logp, old, rollout, adv, torch.ones(1, 3), denominator=3.0, tis_cap=2.0)
    loss.backward()
    assert rollout.grad is None
    assert logp.grad is not None and old.grad is not None
    torch.testing.assert_close(old.grad, -logp.grad)


# ---------------------------------------------------------------- masks

def garbage_batch() -> dict[str, torch.Tensor]:
    """Two rows; mask-0 positions hold padding, stale logprobs, inf and NaN."""
    nan, inf = float("nan"), float("inf")
    return {
        "logp": rows([-0.5, -1.0, nan, -0.2], [-2.0, inf, -0.3, -0.1]),
        "old": rows([-0.6, -1.0, -50.0, -0.1], [-1.5, -inf, -0.3, nan]),
        "rollout": rows([-0.7, -0.9, 80.0, -0.1], [-1.0, 0.0, -0.3, -90.0]),
        "adv": rows([1.0, 1.0, inf, 1.0], [-1.0, nan, -1.0, -1.0]),
        "ref": rows([-0.4, -1.2, nan, 0.0], [-2.5, inf, -0.2, 7.0]),
        "mask": rows([1, 1, 0, 1], [1, 0, 1, 0]),
    }


def compact(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tokens with the masked ones removed (one row of the 5 kept tokens)."""
    keep = batch["mask"] != 0
    return {k: v[keep][None] for k, v in batch.items()}


def run_policy(batch: dict[str, torch.Tensor], **options: object) -> tuple[torch.Tensor, dict, torch.Tensor]:
    logp = batch["logp"].clone().requires_grad_()
    loss, stats = policy_loss(logp, batch["old"], batch["rollout"], batch["adv"], batch["mask"],
                              denominator=5.0, **options)  # type: ignore[arg-type]
    loss.backward()
    assert logp.grad is not None
    return loss.detach(), stats, logp.grad


@pytest.mark.parametrize("with_ref", [False, True])
def test_masked_tokens_give_exactly_zero_loss_and_gradient(with_ref: bool) -> None:
    batch = garbage_batch()
    options = {"ref_logp": batch["ref"], "kl_coef": 0.3} if with_ref else {}
    loss, stats, grad = run_policy(batch, **options)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in stats.values())
    assert torch.equal(grad[batch["mask"] == 0], torch.zeros(3))
    small = compact(batch)
    small_options = {"ref_logp": small["ref"], "kl_coef": 0.3} if with_ref else {}
    loss2, stats2, grad2 = run_policy(small, **small_options)
    torch.testing.assert_close(loss, loss2)
    torch.testing.assert_close(grad[batch["mask"] != 0], grad2[0])
    for key in stats:
        torch.testing.assert_close(stats[key], stats2[key], msg=key)
    assert stats["tokens"].item() == 5


def test_mask_may_be_bool_or_uint8() -> None:
    batch = garbage_batch()
    loss, *_ = run_policy(batch)
    for mask in (batch["mask"].bool(), batch["mask"].to(torch.uint8)):
        other, *_ = run_policy({**batch, "mask": mask})
        torch.testing.assert_close(loss, other)


def test_a_micro_batch_without_trained_tokens() -> None:
    logp = torch.zeros(1, 1, requires_grad=True)
    zero = torch.zeros(1, 1)
    loss, stats = policy_loss(logp, zero, zero, zero, zero, denominator=7.0)
    loss.backward()
    assert loss.item() == 0.0 and logp.grad is not None and logp.grad.item() == 0.0
    assert all(v.item() == 0.0 for v in stats.values())
    assert all(v.dtype == torch.float32 and v.dim() == 0 and not v.requires_grad for v in stats.values())


# ---------------------------------------------------------------- KL and SFT


def test_low_var_kl_by_hand() -> None:
    got = low_var_kl(torch.tensor([-1.0, -1.0, -3.0]), torch.tensor([-2.0, -1.0, -1.0]))
    want = torch.tensor([math.exp(-1) + 1 - 1, 0.0, math.exp(2) - 2 - 1])
    torch.testing.assert_close(got, want)
    rand = low_var_kl(torch.randn(100), torch.randn(100))
    assert bool((rand >= 0).all())


def test_kl_term_adds_to_loss_and_gradient() -> None:
    ref = -0.5  # logp = log(1.1) ~ 0.0953
    base_loss, _, base_grad = one_token(1.1, 1.0)
    loss, stats, grad = one_token(1.1, 1.0, ref=ref, kl_coef=0.5)
    diff = ref - math.log(1.1)
    kl = math.exp(diff) - diff - 1
    assert stats["kl_sum"].item() == pytest.approx(kl)
    assert loss.item() == pytest.approx(base_loss.item() + 0.5 * kl)
    assert grad.item() == pytest.approx(base_grad.item() + 0.5 * (1 - math.exp(diff)))


def test_kl_off_without_reference_and_reported_with_zero_coef() -> None:
    _, stats, _ = one_token(1.1, 1.0, kl_coef=0.5)
    assert stats["kl_sum"].item() == 0.0
    base_loss, _, base_grad = one_token(1.1, 1.0)
    loss, stats, grad = one_token(1.1, 1.0, ref=-0.5, kl_coef=0.0)
    assert stats["kl_sum"].item() > 0
    assert loss.item() == base_loss.item() and grad.item() == base_grad.item()


def test_sft_loss_by_hand() -> None:
    logp = rows([0.0, -1.0, -2.0], [0.0, -0.5, -9.0]).requires_grad_()
    mask = rows([0, 1, 1], [0, 1, 0])
    loss, stats = sft_loss(logp, mask, denominator=3.0, aggregation="token_mean")
    assert loss.item() == pytest.approx(3.5 / 3)
    assert stats["tokens"].item() == 3 and stats["loss_sum"].item() == pytest.approx(3.5)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, -mask / 3)
    seq, _ = sft_loss(logp, mask, denominator=2.0, aggregation="seq_mean_token_sum")
    assert seq.item() == pytest.approx(3.5 / 2)


# ---------------------------------------------------------------- aggregation


def test_aggregations_divide_the_token_sum_by_the_denominator() -> None:
    batch = compact(garbage_batch())
    per_token = run_policy(batch)[1]["loss_sum"].item()
    for aggregation, denominator in (("token_mean", 5.0), ("seq_mean_token_sum", 2.0), ("token_mean", 40.0)):
        logp = batch["logp"].clone().requires_grad_()
        loss, stats = policy_loss(logp, batch["old"], batch["rollout"], batch["adv"], batch["mask"],
                                  denominator=denominator, aggregation=aggregation)  # type: ignore[arg-type]
        assert loss.item() == pytest.approx(per_token / denominator)
        assert stats["loss_sum"].item() == pytest.approx(per_token)  # the stats never depend on the denominator


@pytest.mark.parametrize("bad", [{"aggregation": "seq_mean_token_mean"}, {"denominator": 0.0},
                                 {"denominator": -3.0}, {"denominator": float("nan")}])
def test_bad_aggregation_or_denominator(bad: dict) -> None:
    options = {"denominator": 4.0, "aggregation": "token_mean", **bad}
    with pytest.raises(ConfigError):
        policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2),
                    **options)
    with pytest.raises(ConfigError):
        sft_loss(torch.zeros(1, 2), torch.ones(1, 2), **options)


# ---------------------------------------------------------------- the key invariant: any split, same result

VOCAB, WIDTH = 23, 8


class TinyLM(torch.nn.Module):
    """Logits from each token's embedding and position (enough to be a function of the parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.pos = torch.nn.Embedding(32, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids) + self.pos(torch.arange(ids.shape[1]))))


def perturbed(model: TinyLM, scale: float, seed: int) -> TinyLM:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return other


def make_samples(model: TinyLM, count: int = 7) -> list[dict]:
    """Samples of different lengths: a prompt (mask 0), engine tokens (mask 1) with an observation gap (mask 0);
    the engine's logprobs are the policy's plus noise (so the TIS weight varies, and is sometimes capped)."""
    gen = torch.Generator().manual_seed(11)
    samples = []
    for i in range(count):
        n = 5 + (i * 3) % 11
        tokens = torch.randint(0, VOCAB, (n,), generator=gen)
        mask = torch.zeros(n)
        mask[2:] = 1
        mask[n // 2] = 0
        if i == 3:
            mask[:] = 0  # a sample without trained tokens
        with torch.no_grad():
            lp = token_logprobs(model(tokens[None]), tokens[None])[0]
        rollout = (lp + torch.randn(n, generator=gen) * 0.6) * mask
        samples.append({"tokens": tokens, "mask": mask, "rollout": rollout, "adv": [1.3, -0.7, 0.0, 2.0][i % 4]})
    return samples


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    width = max(len(s["tokens"]) for s in samples)
    out = {"tokens": torch.zeros(len(samples), width, dtype=torch.long), "mask": torch.zeros(len(samples), width),
           "rollout": torch.zeros(len(samples), width), "adv": torch.zeros(len(samples), width)}
    for row, s in enumerate(samples):
        n = len(s["tokens"])
        out["tokens"][row, :n] = s["tokens"]
        out["mask"][row, :n] = s["mask"]
        out["rollout"][row, :n] = s["rollout"]
        out["adv"][row, :n] = s["adv"]  # broadcast to every token, mask-0 ones included, as the trainer does
    return out


def denominators(samples: list[dict]) -> dict[str, float]:
    counts = [int(s["mask"].sum()) for s in samples]
    return {"token_mean": float(sum(counts)), "seq_mean_token_sum": float(sum(1 for c in counts if c))}


LossFn = Callable[[TinyLM, dict[str, torch.Tensor], float, str], tuple[torch.Tensor, dict]]


def grpo_loss(old: TinyLM, ref: TinyLM) -> LossFn:
    def fn(model: TinyLM, mb: dict[str, torch.Tensor], denominator: float, aggregation: str
           ) -> tuple[torch.Tensor, dict]:
        logp = token_logprobs(model(mb["tokens"]), mb["tokens"], chunk_rows=5)
        with torch.no_grad():
            old_logp = token_logprobs(old(mb["tokens"]), mb["tokens"])
            ref_logp = token_logprobs(ref(mb["tokens"]), mb["tokens"])
        return policy_loss(logp, old_logp, mb["rollout"], mb["adv"], mb["mask"], denominator=denominator,
                           aggregation=aggregation, tis_cap=1.5, ref_logp=ref_logp,  # type: ignore[arg-type]
                           kl_coef=0.1)
    return fn


def sft_fn(model: TinyLM, mb: dict[str, torch.Tensor], denominator: float, aggregation: str
           ) -> tuple[torch.Tensor, dict]:
    logp = token_logprobs(model(mb["tokens"]), mb["tokens"])
    return sft_loss(logp, mb["mask"], denominator=denominator, aggregation=aggregation)  # type: ignore[arg-type]


def run_rank(model: TinyLM, samples: list[dict], plan: list[list[int]], fn: LossFn, denominator: float,
             aggregation: str) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One rank's gradient accumulation over its micro-batches: the summed loss, stats and gradients."""
    model = copy.deepcopy(model)
    total = 0.0
    stats: dict[str, torch.Tensor] = {}
    for indices in plan:
        loss, micro = fn(model, collate([samples[i] for i in indices]), denominator, aggregation)
        loss.backward()
        total += loss.item()
        for key, value in micro.items():
            stats[key] = torch.maximum(stats[key], value) if key in MAX_STATS and key in stats \
                else stats.get(key, 0) + value
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return total, stats, grads


SPLITS = {
    "whole": [[[0, 1, 2, 3, 4, 5, 6]]],
    "micro-batches": [[[0, 1], [2], [3, 4, 5], [6]]],
    "2 ranks": [[[0, 2, 4, 6]], [[1, 3, 5]]],
    "2 ranks of micro-batches": [[[6], [0, 3]], [[5, 1], [2], [4]]],
}


@pytest.mark.parametrize("algorithm", ["grpo", "sft"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum"])
def test_any_split_gives_the_whole_batch_loss_and_gradients(algorithm: str, aggregation: str) -> None:
    torch.manual_seed(0)
    model = TinyLM()
    samples = make_samples(model)
    fn = grpo_loss(perturbed(model, 0.15, 1), perturbed(model, 0.1, 2)) if algorithm == "grpo" else sft_fn
    denominator = denominators(samples)[aggregation]
    results = {}
    for name, ranks in SPLITS.items():
        per_rank = [run_rank(model, samples, plan, fn, denominator, aggregation) for plan in ranks]
        loss = sum(r[0] for r in per_rank)
        grads = {k: sum(r[2][k] for r in per_rank) for k in per_rank[0][2]}  # all-reduce SUM
        stats = {k: (torch.stack([r[1][k] for r in per_rank]).max() if k in MAX_STATS
                     else sum(r[1][k] for r in per_rank)) for k in per_rank[0][1]}
        results[name] = (loss, grads, stats)
    whole_loss, whole_grads, whole_stats = results["whole"]
    assert whole_stats["loss_sum"].item() / denominator == pytest.approx(whole_loss, rel=1e-5)
    assert whole_stats["tokens"].item() == denominators(samples)["token_mean"]
    if algorithm == "grpo":  # the data exercises clipping and the TIS cap, so the invariant covers them
        assert whole_stats["clipped_low"] + whole_stats["clipped_high"] > 0
        assert whole_stats["tis_clipped"] > 0 and whole_stats["kl_sum"] > 0
    for name, (loss, grads, stats) in results.items():
        assert loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7), name
        for key in whole_grads:
            torch.testing.assert_close(grads[key], whole_grads[key], atol=1e-6, rtol=1e-5, msg=f"{name} {key}")
        for key in whole_stats:
            torch.testing.assert_close(stats[key], whole_stats[key], atol=1e-5, rtol=1e-5, msg=f"{name} {key}")


def test_prob_weight_scales_each_tokens_advantage_by_its_probability() -> None:
    """Advantage reweighting: with alpha = prob_weight, a token's gradient is that of the plain loss times
    alpha * p + 1 - alpha (p = exp(old_logp)), so an unlikely token no longer dominates; 0 changes nothing."""
    probs = torch.tensor([[0.9, 0.05, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])

    def grad(alpha: float, adv: float) -> torch.Tensor:
        logp = probs.log().clone().requires_grad_(True)
        loss, _ = policy_loss(logp, logp.detach(), logp.detach(), torch.full((1, 3), adv), mask, denominator=2.0,
                              prob_weight=alpha)
        loss.backward()
        assert logp.grad is not None
        return logp.grad[0]

    plain = grad(0.0, -1.0)
    assert torch.allclose(plain, torch.tensor([0.5, 0.5, 0.0]))  # -A * ratio / denominator, masked token 0
    assert torch.allclose(grad(1.0, -1.0), plain * torch.tensor([0.9, 0.05, 0.0]))
    assert torch.allclose(grad(0.5, 1.0), -plain * torch.tensor([0.95, 0.525, 0.0]))
    with pytest.raises(ValueError, match="prob_weight"):
        policy_loss(probs.log(), probs.log(), probs.log(), torch.ones(1, 3), mask, denominator=2.0, prob_weight=1.5)
