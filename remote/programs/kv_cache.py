"""The CPU engine's KV cache: transformers' DynamicCache with layers that grow in place.

transformers' ``DynamicLayer`` appends each decode step's key and value by concatenation, which copies the
whole cache of every layer on every token: at 8 sequences of 1,300 tokens that copy was over half the time of a
decode step of the tiny model (benchmarks/engine_decode.py). ``SpareRoomLayer`` keeps the keys and values in
buffers with room to spare along the sequence, writes each step's position in place and hands attention views of
the filled part; it grows (one copy) only when the room runs out, by half again what it holds.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_SPARE = 256  # positions of room a layer keeps at least when it (re)allocates


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
        room = needed + max(MIN_SPARE, needed // 2)
        keys = key_states.new_empty((*key_states.shape[:-2], room, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], room, value_states.shape[-1]))
        if self.length:
            keys[..., : self.length, :] = self.keys
            values[..., : self.length, :] = self.values
        self._key_room, self._value_room = keys, values

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
