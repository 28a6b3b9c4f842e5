"""What crosses from the controller to the trainer ranks (docs/architecture.md 8.3): ``TrainSample`` and ``TrainBatch``.

Token arrays travel as raw little-endian bytes (``tokens`` int32, ``loss_mask`` uint8, ``logprobs`` float32),
never as lists of Python ints: msgspec copies bytes at memory speed and the ranks view them with
``numpy.frombuffer`` / ``torch.frombuffer`` without a decode loop. ``pack_sample`` / ``unpack_*`` convert.

A batch carries the denominators of the loss aggregation over the *whole* global batch (``loss_tokens``,
``sequences``), so the loss does not depend on how the batch is split into ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

Algorithm = Literal["grpo", "sft"]


class TrainSample(msgspec.Struct, frozen=True, kw_only=True):
    """One training sequence: the tokens of an episode (or of one agent step), its mask, the engine's
    logprobs and the advantage every mask-1 token gets."""

    uid: str  # "<instance_id>#<sample>" (with ".<step>" in per-step sample mode)
    group: str  # the group key: the task's instance_id
    tokens: bytes  # int32 little-endian
    loss_mask: bytes  # uint8: 1 = emitted by the engine (trained on), 0 = prompt, observation, template
    logprobs: bytes  # float32: the engine's logprob per token (0.0 where the mask is 0)
    advantage: float = 0.0
    reward: float = 0.0
    weight_version: int = 0  # the policy version that sampled it (staleness = trainer version - this)
    truncated: bool = False

    @property
    def length(self) -> int:
        return len(self.tokens) // 4


class TrainBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One optimizer step's samples plus the global denominators of the loss."""

    step: int
    algorithm: Algorithm
    samples: list[TrainSample]
    loss_tokens: int  # mask-1 tokens over the whole batch (token-mean denominator)
    sequences: int  # samples with at least one mask-1 token (sequence-mean denominator)


def pack_sample(uid: str, group: str, tokens: Sequence[int], loss_mask: Sequence[int],
                logprobs: Sequence[float], **fields: object) -> TrainSample:
    """A TrainSample from Python lists (checks that the three arrays have one length)."""
    n = len(tokens)
    if not (len(loss_mask) == len(logprobs) == n):
        raise ValueError(f"sample {uid}: tokens, loss_mask and logprobs differ in length "
                         f"({n}, {len(loss_mask)}, {len(logprobs)})")
    return TrainSample(
        uid=uid, group=group,
        tokens=np.asarray(tokens, dtype="<i4").tobytes(),
        loss_mask=np.asarray(loss_mask, dtype=np.uint8).tobytes(),
        logprobs=np.asarray(logprobs, dtype="<f4").tobytes(),
        **fields,  # type: ignore[arg-type]
    )


def unpack_tokens(sample: TrainSample) -> np.ndarray:
    return np.frombuffer(sample.tokens, dtype="<i4")


def unpack_mask(sample: TrainSample) -> np.ndarray:
    return np.frombuffer(sample.loss_mask, dtype=np.uint8)


def unpack_logprobs(sample: TrainSample) -> np.ndarray:
    return np.frombuffer(sample.logprobs, dtype="<f4")


def make_batch(step: int, algorithm: Algorithm, samples: list[TrainSample]) -> TrainBatch:
    """A TrainBatch with its denominators computed from ``samples``."""
    counts = [int(unpack_mask(s).sum()) for s in samples]
    return TrainBatch(step=step, algorithm=algorithm, samples=samples, loss_tokens=sum(counts),
                      sequences=sum(1 for c in counts if c))
