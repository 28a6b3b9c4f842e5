"""The CPU engine's KV cache: transformers' DynamicCache with layers that grow in place.

transformers' ``DynamicLayer`` appends each decode step's key and value by concatenation, which copies the
whole cache of every layer on every token: at 8 sequences of 1,300 tokens that copy was over half the time of a
decode step of the tiny model (benchmarks/engine_decode.py). ``SpareRoomLayer`` keeps the keys and values in
buffers with room to spare along the sequence, writes each step's position in place and hands attention views of
the filled part; it grows (one copy) only when the room runs out, by half again what it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_SPARE = 256  # positions of room a layer keeps at least when it (re)allocates


def _room(needed: int) -> int:
    """Positions a layer allocates when it must hold ``needed``: half again, and at least MIN_SPARE more."""
    return needed + max(MIN_SPARE, needed // 2)


class SpareRoomLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are views of larger buffers (``[batch, heads, room,
    head_dim]``); ``length`` positions are filled."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.length = 0
        self._key_room: torch.Tensor | None = None
        self._value_room: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self._key_room is None or self.length + new > self._key_room.shape[-2]:
            self._grow(key_states, value_states, self.length + new)
        assert self._key_room is not None and self._value_room is not None
        self._key_room[..., self.length : self.length + new, :] = key_states
        self._value_room[..., self.length : self.length + new, :] = value_states
        self.length += new
        self._expose()
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        room = _room(needed)
        keys = key_states.new_empty((*key_states.shape[:-2], room, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], room, value_states.shape[-1]))
        if self.length:
            keys[..., : self.length, :] = self.keys
            values[..., : self.length, :] = self.values
        self._key_room, self._value_room = keys, values

    def fill_rows(self, parts: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> None:
        """Become the rows of ``parts`` (keys and values ``[rows, heads, length, head_dim]`` each), stacked in order
        and each left-padded with zeros to ``width`` positions, with the room ``update`` would give: one copy of
        each part into the new buffers (stacking the padded parts first and then growing copied all of them twice
        more, which was most of the time of a newcomer's join into a running batch)."""
        first_keys, first_values = parts[0]
        self.lazy_initialization(first_keys, first_values)
        rows = sum(keys.shape[0] for keys, _ in parts)
        room = _room(width)
        keys_room = first_keys.new_empty((rows, first_keys.shape[1], room, first_keys.shape[-1]))
        values_room = first_values.new_empty((rows, first_values.shape[1], room, first_values.shape[-1]))
        row = 0
        for keys, values in parts:
            count, pad = keys.shape[0], width - keys.shape[-2]
            if pad < 0:
                raise ValueError(f"a part of {keys.shape[-2]} positions is wider than {width}")
            if pad:  # masked out, but must hold no NaN: a zero attention weight times NaN is NaN
                keys_room[row : row + count, :, :pad].zero_()
                values_room[row : row + count, :, :pad].zero_()
            keys_room[row : row + count, :, pad:width] = keys
            values_room[row : row + count, :, pad:width] = values
            row += count
        self._key_room, self._value_room, self.length = keys_room, values_room, width
        self._expose()

    def _expose(self) -> None:
        assert self._key_room is not None and self._value_room is not None
        self.keys = self._key_room[..., : self.length, :]
        self.values = self._value_room[..., : self.length, :]

    def drop_front(self, count: int) -> None:
        """Forget the first ``count`` positions (padding no row attends to); no copy: the buffers become views that
        start later, their spare room still at the end."""
        if self._key_room is None or not 0 < count <= self.length:
            raise ValueError(f"cannot drop {count} of {self.length} positions")
        self._key_room = self._key_room[..., count:, :]
        self._value_room = self._value_room[..., count:, :]
        self.length -= count
        self._expose()

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._key_room is not None and self.length:
            self._key_room = self._key_room[indices, ...]
            self._value_room = self._value_room[indices, ...]
            self._expose()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._key_room is not None and self.length:
            self._key_room = self._key_room.repeat_interleave(repeats, dim=0)
            self._value_room = self._value_room.repeat_interleave(repeats, dim=0)
            self._expose()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove and self._key_room is not None:
            self.length = max(0, self.length + tokens_to_remove)
            self._expose()

    def reset(self) -> None:
        self.length = 0
        self._key_room = self._value_room = None
        super().reset()


def decode_cache(config: Any) -> DynamicCache:
    """A DynamicCache for ``config`` whose full-attention layers are ``SpareRoomLayer``s (other layer kinds, such as
    sliding-window ones, keep transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [SpareRoomLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class PrefixStore:
    """The KV of recently finished sequences, kept for the requests that begin the same way: an agent's next turn
    sends the whole conversation again (its prompt begins with the last turn's prompt and output), and the samples
    of one task share their first prompt. A new request reuses the longest common beginning and computes only the
    rest. It holds at most ``max_bytes`` of KV, least recently used entries going first; a weight update must
    ``clear`` it (the KV belongs to the weights that computed it)."""

    def __init__(self, max_bytes: int, *, min_tokens: int = 32) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens  # shorter common beginnings are computed afresh
        self._store: OrderedDict[int, tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], int]] = (
            OrderedDict())
        self._next = 0
        self.bytes = 0
        self.hits = 0
        self.tokens_reused = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._store)

    def put(self, tokens: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep ``kv`` (per layer, keys and values of shape ``[1, heads, len(tokens), head_dim]``) for ``tokens``."""
        size = sum(keys.nbytes + values.nbytes for keys, values in kv)
        if len(tokens) < self.min_tokens or size > self.max_bytes:
            return
        self._store[self._next] = (torch.tensor(tokens, dtype=torch.long), kv, size)
        self._next += 1
        self.bytes += size
        while self.bytes > self.max_bytes:
            self.bytes -= self._store.popitem(last=False)[1][2]

    def longest(self, tokens: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The longest beginning of ``tokens`` some entry holds (at most all but the last token, which the model
        must still read to give the next token's logits) and that entry's KV, or None below ``min_tokens``."""
        if not self._store or len(tokens) <= self.min_tokens:
            return None
        wanted = torch.tensor(tokens, dtype=torch.long)
        best, best_key = 0, None
        for key, (held, _, _) in self._store.items():
            m = min(len(held), len(wanted) - 1)
            differ = (held[:m] != wanted[:m]).nonzero()
            common = int(differ[0]) if len(differ) else m
            if common > best:
                best, best_key = common, key
        if best_key is None or best < self.min_tokens:
            return None
        self._store.move_to_end(best_key)
        self.hits += 1
        self.tokens_reused += best
        return best, self._store[best_key][1]

    def clear(self) -> None:
        self._store.clear()
        self.bytes = 0
