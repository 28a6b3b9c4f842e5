"""The CPU engine's KV cache: transformers' DynamicCache with layers that grow in place.

transformers' ``DynamicLayer`` appends each decode step's key and value by concatenation, which copies the
whole cache of every layer on every token: at 8 sequences of 1,300 tokens that copy was over half the time of a
decode step of the tiny model (benchmarks/engine_decode.py). ``SpareRoomLayer`` keeps the keys and values in
buffers with room to spare along the sequence, writes each step's position in place and hands attention views of
the filled part; it grows (one copy) only when the room runs out, by half again what it holds. Room for more rows
and to the left lets a newcomer join a running batch, and a finished row leave it, without copying the others.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_SPARE = 256  # positions of room a layer keeps at least when it (re)allocates
LEFT_SPARE = 256  # positions before the filled part: a wider newcomer joins by widening the padding in place
ROW_SPARE = 8  # rows of room a merged batch keeps for newcomers to join in place


def _room(needed: int) -> int:
    """Positions a layer allocates when it must hold ``needed``: half again, and at least MIN_SPARE more."""
    return needed + max(MIN_SPARE, needed // 2)


class SpareRoomLayer(DynamicLayer):
    """A full-attention cache layer whose keys and values are views of larger buffers (``[row room, heads,
    LEFT_SPARE + room, head_dim]``): ``rows`` rows and ``length`` positions from ``start`` are filled.

    The room to the right takes decode steps in place; the rows and the room to the left take newcomers in place
    (``take_rows``: a join copies the newcomers only, not the batch), and a row leaving the batch costs a copy of the
    rows that move into its slot (``keep_rows``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.length = 0
        self.rows = 0
        self.start = 0
        self._key_base: torch.Tensor | None = None
        self._value_base: torch.Tensor | None = None

    @property
    def _key_room(self) -> torch.Tensor | None:
        """The filled rows from the first filled position to the end of the room."""
        return None if self._key_base is None else self._key_base[: self.rows, :, self.start :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        if self._key_base is None or self.start + self.length + new > self._key_base.shape[-2]:
            self._grow(key_states, value_states, self.length + new)
        assert self._key_base is not None and self._value_base is not None
        at = slice(self.start + self.length, self.start + self.length + new)
        self._key_base[: self.rows, :, at] = key_states
        self._value_base[: self.rows, :, at] = value_states
        self.length += new
        self._expose()
        return self.keys, self.values

    def _allocate(self, like: torch.Tensor, rows: int, needed: int) -> torch.Tensor:
        return like.new_empty((rows, like.shape[1], LEFT_SPARE + _room(needed), like.shape[-1]))

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        rows = max(key_states.shape[0], 0 if self._key_base is None else self._key_base.shape[0])
        keys = self._allocate(key_states, rows, needed)
        values = self._allocate(value_states, rows, needed)
        if self.length:
            keys[: self.rows, :, LEFT_SPARE : LEFT_SPARE + self.length] = self.keys
            values[: self.rows, :, LEFT_SPARE : LEFT_SPARE + self.length] = self.values
        else:
            self.rows = key_states.shape[0]
        self._key_base, self._value_base, self.start = keys, values, LEFT_SPARE

    def fill_rows(self, parts: list[tuple[torch.Tensor, torch.Tensor]], width: int, *, row_spare: int = 0) -> None:
        """Become the rows of ``parts`` (keys and values ``[rows, heads, length, head_dim]`` each), stacked in order
        and each left-padded with zeros to ``width`` positions, with the room ``update`` would give and ``row_spare``
        rows more: one copy of each part into the new buffers (stacking the padded parts first and then growing
        copied all of them twice more, which was most of the time of a newcomer's join into a running batch)."""
        first_keys, first_values = parts[0]
        self.lazy_initialization(first_keys, first_values)
        rows = sum(keys.shape[0] for keys, _ in parts)
        self._key_base = self._allocate(first_keys, rows + row_spare, width)
        self._value_base = self._allocate(first_values, rows + row_spare, width)
        self.rows, self.start, self.length = 0, LEFT_SPARE, width
        for keys, values in parts:
            self._write_rows(keys, values)
        self._expose()

    def _write_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Fill the next rows with ``keys`` and ``values``, left-padded with zeros to ``length`` positions."""
        assert self._key_base is not None and self._value_base is not None
        count, pad = keys.shape[0], self.length - keys.shape[-2]
        if pad < 0:
            raise ValueError(f"a part of {keys.shape[-2]} positions is wider than {self.length}")
        rows = slice(self.rows, self.rows + count)
        if pad:  # masked out, but must hold no NaN: a zero attention weight times NaN is NaN
            self._key_base[rows, :, self.start : self.start + pad].zero_()
            self._value_base[rows, :, self.start : self.start + pad].zero_()
        self._key_base[rows, :, self.start + pad : self.start + self.length] = keys
        self._value_base[rows, :, self.start + pad : self.start + self.length] = values
        self.rows += count

    def can_take(self, rows: int, width: int) -> bool:
        """Whether ``take_rows`` can add ``rows`` rows and widen the batch to ``width`` positions in place."""
        return (self._key_base is not None and self.length > 0 and self.rows + rows <= self._key_base.shape[0]
                and width >= self.length and width - self.length <= self.start)

    def take_rows(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
        """Add the rows of ``keys`` and ``values`` after the filled ones, the batch padded on the left to ``width``
        positions (``can_take`` must hold): copies the newcomers only."""
        if not self.can_take(keys.shape[0], width):
            raise ValueError(f"no room for {keys.shape[0]} more rows of {width} positions")
        assert self._key_base is not None and self._value_base is not None
        wider = width - self.length
        if wider:
            before = slice(self.start - wider, self.start)
            self._key_base[: self.rows, :, before].zero_()
            self._value_base[: self.rows, :, before].zero_()
            self.start -= wider
            self.length = width
        self._write_rows(keys, values)
        self._expose()

    def _expose(self) -> None:
        assert self._key_base is not None and self._value_base is not None
        filled = slice(self.start, self.start + self.length)
        self.keys = self._key_base[: self.rows, :, filled]
        self.values = self._value_base[: self.rows, :, filled]

    def drop_front(self, count: int) -> None:
        """Forget the first ``count`` positions (padding no row attends to); no copy: they become room to the
        left."""
        if self._key_base is None or not 0 < count <= self.length:
            raise ValueError(f"cannot drop {count} of {self.length} positions")
        self.start += count
        self.length -= count
        self._expose()

    def get_seq_length(self) -> int:
        return self.length

    def keep_rows(self, moves: list[tuple[int, int]], rows: int) -> None:
        """Keep the first ``rows`` rows, after copying row ``src`` into row ``dst`` for each ``(dst, src)`` of
        ``moves`` (the filled positions only). A finished row's slot takes a live row from the end, so a row leaving
        the batch costs a copy of the rows that move, not of every row (``batch_select_indices`` copied the whole
        room of every kept row, a tenth of the engine's time at 16 rows)."""
        if self._key_base is None or not self.length:
            return
        if moves:
            dst = torch.tensor([d for d, _ in moves], dtype=torch.long, device=self._key_base.device)
            src = torch.tensor([s for _, s in moves], dtype=torch.long, device=self._key_base.device)
            filled = slice(self.start, self.start + self.length)
            self._key_base[dst, :, filled] = self._key_base[src, :, filled]
            self._value_base[dst, :, filled] = self._value_base[src, :, filled]
        self.rows = rows
        self._expose()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._key_base is not None and self.length:
            self._key_base = self._key_base[indices, ...]
            self._value_base = self._value_base[indices, ...]
            self.rows = len(indices)
            self._expose()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._key_base is not None and self.length:
            self._key_base = self._key_base[: self.rows].repeat_interleave(repeats, dim=0)
            self._value_base = self._value_base[: self.rows].repeat_interleave(repeats, dim=0)
            self.rows *= repeats
            self._expose()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove and self._key_base is not None:
            self.length = max(0, self.length + tokens_to_remove)
            self._expose()

    def reset(self) -> None:
        self.length = self.rows = self.start = 0
        self._key_base = self._value_base = None
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
