"""plan_micro_batches: every index once, the same number of micro-batches on every rank, padded sizes within
the budget, balanced ranks, determinism; examples and property checks over random lengths."""

from __future__ import annotations

import random

import pytest

from swectl.rl.packing import balance_ranks, padded_tokens, plan_micro_batches


def check_plan(plan: list[list[list[int]]], lengths: list[int], ranks: int, budget: int) -> None:
    """The properties every plan has."""
    assert len(plan) == ranks
    assert len({len(micro) for micro in plan}) == 1, "ranks differ in micro-batch count"
    seen = sorted(i for micro in plan for mb in micro for i in mb)
    assert seen == list(range(len(lengths))), "an index is missing or repeated"
    for micro in plan:
        filled = [mb for mb in micro if mb]
        assert micro[:len(filled)] == filled, "empty micro-batches only pad the end"
        for mb in filled:
            assert mb == sorted(mb)
            assert padded_tokens(mb, lengths) <= budget or len(mb) == 1, (mb, [lengths[i] for i in mb])
    loads = [sum(lengths[i] for mb in micro for i in mb) for micro in plan]
    assert max(loads) - min(loads) <= max(lengths, default=0)


def test_an_example_by_hand() -> None:
    lengths = [5000, 3000, 8000, 100, 200, 9000, 4000]
    plan = plan_micro_batches(lengths, ranks=2, token_budget=8192)
    # rank 0: 9000 (over the budget: alone), then 4000 + 3000 (padded 8000); rank 1: 8000, 5000, 200 + 100
    assert plan == [[[5], [1, 6], []], [[2], [0], [3, 4]]]
    check_plan(plan, lengths, 2, 8192)


def test_one_rank_packs_by_padded_size() -> None:
    # padded size = longest x count: four 1000s fit 4096, the 3000 does not pair with anything
    plan = plan_micro_batches([1000, 1000, 3000, 1000, 1000, 10], ranks=1, token_budget=4096)
    assert plan == [[[2], [0, 1, 3, 4], [5]]]


def test_more_ranks_than_samples_pads_with_empty_micro_batches() -> None:
    assert plan_micro_batches([7, 7, 7], ranks=4, token_budget=100) == [[[0]], [[1]], [[2]], [[]]]


def test_no_samples_gives_every_rank_nothing() -> None:
    assert plan_micro_batches([], ranks=3, token_budget=10) == [[], [], []]


def test_samples_over_the_budget_go_alone() -> None:
    plan = plan_micro_batches([50, 60, 70], ranks=1, token_budget=10)
    assert plan == [[[2], [1], [0]]]


def test_zero_length_samples_are_placed_too() -> None:
    lengths = [0, 0, 5]
    plan = plan_micro_batches(lengths, ranks=2, token_budget=5)
    check_plan(plan, lengths, 2, 5)


def test_balance_spreads_tokens() -> None:
    lengths = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    loads = [sum(lengths[i] for i in rank) for rank in balance_ranks(lengths, 3)]
    assert max(loads) - min(loads) <= 2


def test_max_rows_caps_samples_per_micro_batch() -> None:
    lengths = [700, 1600, 950, 1200, 880, 1400, 1020, 760]
    plan = plan_micro_batches(lengths, ranks=1, token_budget=8192, max_rows=1)
    assert plan == [[[1], [5], [3], [6], [2], [4], [7], [0]]], "one sample per forward, longest first"
    two = plan_micro_batches(lengths, ranks=2, token_budget=8192, max_rows=3)
    check_plan(two, lengths, 2, 8192)
    assert all(len(mb) <= 3 for micro in two for mb in micro)
    assert plan_micro_batches(lengths, ranks=1, token_budget=8192) == [[[1, 2, 3, 5, 6], [0, 4, 7]]], "by budget"


def test_max_rows_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_rows"):
        plan_micro_batches([1, 2], ranks=1, token_budget=10, max_rows=0)


@pytest.mark.parametrize(("ranks", "budget"), [(0, 10), (1, 0)])
def test_bad_arguments(ranks: int, budget: int) -> None:
    with pytest.raises(ValueError):
        plan_micro_batches([1, 2], ranks=ranks, token_budget=budget)


def test_negative_length_is_refused() -> None:
    with pytest.raises(ValueError, match="sample 1"):
        plan_micro_batches([1, -2], ranks=1, token_budget=10)


@pytest.mark.parametrize("seed", range(200))
def test_properties_over_random_lengths(seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.choice([1, 2, 3, 4, 8])
    budget = rng.choice([1, 100, 4096, 8192, 16384, 65536])
    n = rng.choice([0, 1, 2, 7, 64, 300])
    top = rng.choice([10, 1000, 8192, 40000])
    lengths = [rng.randint(0 if rng.random() < 0.05 else 1, top) for _ in range(n)]
    plan = plan_micro_batches(lengths, ranks=ranks, token_budget=budget)
    check_plan(plan, lengths, ranks, budget)
    assert plan == plan_micro_batches(list(lengths), ranks=ranks, token_budget=budget), "not deterministic"
    for micro in plan:  # no fewer micro-batches than the tokens need
        mine = [lengths[i] for mb in micro for i in mb]
        over = sum(1 for n in mine if n > budget)
        assert len([mb for mb in micro if mb]) >= over + -(-sum(n for n in mine if n <= budget) // budget)
