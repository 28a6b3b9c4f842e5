"""The CPU engine's in-place KV cache layer holds exactly what transformers' concatenating DynamicLayer holds,
through prefill, decode steps past its spare room, dropped rows and crops."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the KV cache needs torch (pip install torch==2.13.0)")
pytest.importorskip("transformers", reason="the KV cache needs transformers")

from transformers.cache_utils import DynamicLayer  # noqa: E402

from swectl.remote.programs.kv_cache import MIN_SPARE, PrefixStore, SpareRoomLayer, decode_cache  # noqa: E402


def _same(a: DynamicLayer, b: DynamicLayer) -> None:
    assert a.get_seq_length() == b.get_seq_length()
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_spare_room_layer_matches_the_concatenating_layer() -> None:
    gen = torch.Generator().manual_seed(0)
    ours, theirs = SpareRoomLayer(), DynamicLayer()
    prompt = torch.randn(3, 2, 40, 8, generator=gen), torch.randn(3, 2, 40, 8, generator=gen)
    for layer in (ours, theirs):
        got = layer.update(*prompt)
    assert torch.equal(got[0], prompt[0])
    _same(ours, theirs)
    room = ours._key_room.shape[-2]
    rows = 3
    for step in range(MIN_SPARE + 60):  # past the first room: one reallocation
        kv = torch.randn(rows, 2, 1, 8, generator=gen), torch.randn(rows, 2, 1, 8, generator=gen)
        k, v = ours.update(*kv)
        k2, v2 = theirs.update(*kv)
        assert torch.equal(k, k2) and torch.equal(v, v2) and k.shape[0] == rows
        if step == 100:  # a finished row leaves the batch
            keep = torch.tensor([0, 2])
            ours.batch_select_indices(keep)
            theirs.batch_select_indices(keep)
            _same(ours, theirs)
            rows = 2
    assert ours._key_room.shape[-2] > room, "the room grew"
    _same(ours, theirs)
    ours.drop_front(7)  # positions no row attends to any more
    theirs.keys, theirs.values = theirs.keys[..., 7:, :], theirs.values[..., 7:, :]
    _same(ours, theirs)
    kv = torch.randn(rows, 2, 1, 8, generator=gen), torch.randn(rows, 2, 1, 8, generator=gen)
    assert all(torch.equal(a, b) for a, b in zip(ours.update(*kv), theirs.update(*kv), strict=True))
    with pytest.raises(ValueError, match="cannot drop"):
        ours.drop_front(ours.length + 1)
    ours.crop(-5)
    theirs.crop(-5)
    _same(ours, theirs)
    ours.reset()
    assert ours.get_seq_length() == 0 and not ours.is_initialized


def test_filled_rows_are_the_parts_left_padded_and_stacked_with_room_to_grow() -> None:
    """A join builds the batch's cache from its parts in one copy; it must hold what stacking the zero-padded parts
    holds (the engine's merge did that before), and decode on from there like a layer that was updated."""
    gen = torch.Generator().manual_seed(1)
    parts = [(torch.randn(rows, 2, length, 8, generator=gen), torch.randn(rows, 2, length, 8, generator=gen))
             for rows, length in ((3, 50), (1, 64), (2, 9))]

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.new_zeros((*t.shape[:2], 64 - t.shape[2], t.shape[3])), t], dim=2)

    ours, theirs = SpareRoomLayer(), DynamicLayer()
    ours.fill_rows(parts, 64)
    theirs.update(torch.cat([padded(k) for k, _ in parts]), torch.cat([padded(v) for _, v in parts]))
    _same(ours, theirs)
    assert ours.is_initialized and ours.keys.shape == (6, 2, 64, 8)
    assert ours._key_room.shape[-2] == 64 + MIN_SPARE, "the room update gives"
    for _ in range(3):
        kv = torch.randn(6, 2, 1, 8, generator=gen), torch.randn(6, 2, 1, 8, generator=gen)
        assert all(torch.equal(a, b) for a, b in zip(ours.update(*kv), theirs.update(*kv), strict=True))
    with pytest.raises(ValueError, match="wider than"):
        SpareRoomLayer().fill_rows(parts, 32)


def test_decode_cache_uses_the_layer_for_full_attention_only() -> None:
    transformers = pytest.importorskip("transformers")
    full = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=64)
    assert all(type(layer) is SpareRoomLayer for layer in decode_cache(full).layers)
    mixed = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16, intermediate_size=64, vocab_size=64,
                                     use_sliding_window=True, sliding_window=16, max_window_layers=1,
                                     layer_types=["full_attention", "sliding_attention"])
    kinds = [type(layer) for layer in decode_cache(mixed).layers]
    assert kinds[0] is SpareRoomLayer and kinds[1] is not SpareRoomLayer


def _kv(tokens: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 2, tokens, 4), float(i)), torch.full((1, 2, tokens, 4), -float(i))) for i in range(layers)]


def test_prefix_store_finds_the_longest_common_beginning_within_its_byte_budget() -> None:
    entry_bytes = sum(k.nbytes + v.nbytes for k, v in _kv(40))
    store = PrefixStore(max_bytes=2 * entry_bytes + 1, min_tokens=8)
    turn = list(range(100, 140))  # 40 tokens
    other = list(range(100, 110)) + list(range(500, 530))  # shares 10 tokens with `turn`
    store.put(turn, _kv(40))
    store.put(other, _kv(40))
    assert len(store) == 2 and store.bytes == 2 * entry_bytes
    assert store.longest([*turn, 7, 8, 9])[0] == 40  # the next turn: all of the last one
    assert store.longest(turn)[0] == 39  # the model must still read the last token
    assert store.longest([*range(100, 110), 1, 2, 3])[0] == 10
    assert store.longest(list(range(100, 105)) + [1] * 20) is None  # 5 < min_tokens
    assert store.longest([1, 2]) is None
    assert store.hits == 3 and store.tokens_reused == 40 + 39 + 10
    # the last lookup (a tie at 10 tokens) used `other`, so `turn` is the least recently used: over budget, it goes
    store.put(list(range(600, 640)), _kv(40))
    assert len(store) == 2 and store.longest(other)[0] == 39 and store.longest([*turn, 1])[0] == 10
    store.put(list(range(10)), _kv(10_000))  # larger than the whole budget: not kept
    assert len(store) == 2
    store.clear()
    assert len(store) == 0 and store.bytes == 0 and store.longest([*turn, 1]) is None


def test_keep_rows_moves_only_the_rows_that_fill_the_leavers_slots() -> None:
    """A row leaving the batch: the kept rows, in the order ``row_moves`` gives, hold what selecting them holds, and
    the layer decodes on from there like the concatenating one."""
    from swectl.remote.programs.engine_batch import row_moves

    gen = torch.Generator().manual_seed(2)
    ours, theirs = SpareRoomLayer(), DynamicLayer()
    prompt = torch.randn(6, 2, 30, 8, generator=gen), torch.randn(6, 2, 30, 8, generator=gen)
    for layer in (ours, theirs):
        layer.update(*prompt)
    keep = [0, 2, 4, 5]  # rows 1 and 3 leave: row 1's slot takes row 4, row 3's takes row 5; rows 0 and 2 stay put
    order, moves = row_moves(keep)
    assert order == [0, 4, 2, 5] and moves == [(1, 4), (3, 5)]
    ours.keep_rows(moves, len(order))
    theirs.batch_select_indices(torch.tensor(order))
    _same(ours, theirs)
    assert ours._key_room.shape[0] == 4
    for _ in range(3):
        kv = torch.randn(4, 2, 1, 8, generator=gen), torch.randn(4, 2, 1, 8, generator=gen)
        assert all(torch.equal(a, b) for a, b in zip(ours.update(*kv), theirs.update(*kv), strict=True))
    assert row_moves([0, 1, 2]) == ([0, 1, 2], [])  # the last rows left: nothing moves
    assert row_moves([3]) == ([3], [(0, 3)])
