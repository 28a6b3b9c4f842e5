"""Which rank trains which samples, in which micro-batches: ``plan_micro_batches``.

Two stages, both deterministic (every rank computes the same plan from the same lengths, with no collective):

1. Balance tokens across ranks: samples longest first, each onto the rank with the fewest tokens so far (ties:
   fewer samples, then the lower rank). The ranks' token totals then differ by at most the longest sample.
2. Within a rank, pack micro-batches by *padded* size (longest sample x count, what a right-padded forward
   costs): the rank's samples longest first, cut into consecutive runs while ``first length x count`` stays
   within the token budget and the count within ``max_rows``. A sample longer than the budget goes alone.
   (On a CPU a pad costs as much as a token, so the trainer there runs one sample per forward.)

FSDP runs collectives in every forward, so every rank must run the same number of forwards: ranks with fewer
micro-batches get empty ones (``[]``) at the end, which the trainer runs as a dummy forward with zero loss.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def plan_micro_batches(lengths: Sequence[int], *, ranks: int, token_budget: int,
                       max_rows: int | None = None) -> list[list[list[int]]]:
    """For each rank, its micro-batches, each a list of sample indices (ascending) of at most ``max_rows``
    samples (None: no limit); every index appears once and every rank gets the same number of micro-batches
    (padded with ``[]``)."""
    _check_arguments(lengths, ranks, token_budget)
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, not {max_rows}")
    per_rank = [_pack(rank_indices, lengths, token_budget, max_rows)
                for rank_indices in balance_ranks(lengths, ranks)]
    count = max((len(micro) for micro in per_rank), default=0)
    return [micro + [[] for _ in range(count - len(micro))] for micro in per_rank]


def balance_ranks(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Sample indices per rank, greedy longest-first onto the least-loaded rank (token totals within the
    longest sample of each other); each rank's indices in the order they were assigned (longest first)."""
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    heap = [(0, 0, rank) for rank in range(ranks)]  # (tokens, samples, rank): the least loaded on top
    for index in _longest_first(range(len(lengths)), lengths):
        tokens, samples, rank = heap[0]
        assigned[rank].append(index)
        heapq.heapreplace(heap, (tokens + lengths[index], samples + 1, rank))
    return assigned


def padded_tokens(micro_batch: Sequence[int], lengths: Sequence[int]) -> int:
    """What a right-padded forward of ``micro_batch`` costs: its longest sample x its sample count."""
    return max((lengths[i] for i in micro_batch), default=0) * len(micro_batch)


def _pack(indices: Sequence[int], lengths: Sequence[int], token_budget: int,
          max_rows: int | None) -> list[list[int]]:
    """Consecutive runs of the longest-first order whose padded size stays within the budget. Sorted, the first
    sample of a run is its longest, so a run grows while ``lengths[first] * (count + 1) <= token_budget`` (and
    ``count < max_rows``)."""
    micro_batches: list[list[int]] = []
    current: list[int] = []
    for index in _longest_first(indices, lengths):
        full = max_rows is not None and len(current) >= max_rows
        if current and (full or lengths[current[0]] * (len(current) + 1) > token_budget):
            micro_batches.append(sorted(current))
            current = []
        current.append(index)
    if current:
        micro_batches.append(sorted(current))
    return micro_batches


def _longest_first(indices: Sequence[int] | range, lengths: Sequence[int]) -> list[int]:
    return sorted(indices, key=lambda i: (-lengths[i], i))


def _check_arguments(lengths: Sequence[int], ranks: int, token_budget: int) -> None:
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    if token_budget < 1:
        raise ValueError(f"token_budget must be at least 1, not {token_budget}")
    negative = [i for i, n in enumerate(lengths) if n < 0]
    if negative:
        raise ValueError(f"sample lengths cannot be negative (sample {negative[0]}: {lengths[negative[0]]})")
