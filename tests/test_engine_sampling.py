"""The CPU engine's batched draw: each row's tokens follow that row's distribution, tokens without mass are never
drawn, and a row's generator alone decides its draws (same seed, same tokens, whatever the other rows hold)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the engine needs torch (pip install torch==2.13.0)")
pytest.importorskip("transformers", reason="the engine needs transformers")

from swectl.remote.programs.engine_batch import draw  # noqa: E402


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_draws_follow_each_rows_distribution() -> None:
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.0, 0.0, 0.0, 2.0]])  # unnormalised rows are fine
    counts = torch.zeros(2, 4)
    g0, g1 = _gen(0), _gen(1)
    n = 20000
    for _ in range(n):
        a, b = draw(probs, [g0, g1])
        counts[0, a] += 1
        counts[1, b] += 1
    share = counts[0] / n
    assert share[1] == 0 and counts[1, 3] == n
    assert torch.allclose(share, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.012), share  # 4 standard errors


def test_a_row_ending_in_zeros_never_draws_them() -> None:
    probs = torch.zeros(1, 8192)
    probs[0, 5] = 1e-30
    probs[0, 17] = 1.0
    g = _gen(3)
    assert {draw(probs, [g])[0] for _ in range(500)} == {17}
    tail = torch.zeros(1, 4)
    tail[0, 0] = 1.0  # even a uniform draw that rounds up to the total lands on the last token with mass
    assert draw(tail, [_gen(0)]) == [0]


def test_a_rows_generator_alone_decides_its_draws() -> None:
    vocab = 8192
    logits = torch.randn(3, vocab, generator=_gen(7)) * 3
    probs = torch.softmax(logits, dim=-1)
    alone = draw(probs[1:2], [_gen(42)])
    first = draw(probs, [_gen(1), _gen(42), _gen(2)])
    second = draw(probs[[0, 1]], [_gen(99), _gen(42)])
    assert first[1] == alone[0] == second[1]
    g = _gen(42)
    seq_a = [draw(probs[1:2], [g])[0] for _ in range(20)]
    g = _gen(42)
    seq_b = [draw(probs[1:2], [g])[0] for _ in range(20)]
    assert seq_a == seq_b and len(set(seq_a)) > 1
