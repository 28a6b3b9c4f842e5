"""Synthetic TrainBatches with a seeded shape: the batches of the trainer's golden-loss test
(tests/integration/test_trainer.py), which the GPU check (benchmarks/gpu.py) trains on too, so that the two runs
compare loss for loss."""

from __future__ import annotations

import numpy as np

from swectl.rl.batch import Algorithm, TrainBatch, make_batch, pack_sample


def synthetic_batch(step: int, algorithm: Algorithm, vocab: int, *, seed: int, n: int = 6, nan: bool = False
                    ) -> TrainBatch:
    """``n`` samples of 24-63 random tokens: a prompt (mask 0) then a reply (mask 1) with made-up rollout logprobs,
    rewards 1 and advantages of +-1 (NaN with ``nan``), two samples per group."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        length = int(rng.integers(24, 64))
        prompt = int(rng.integers(4, length // 2))
        tokens = rng.integers(3, vocab, size=length).tolist()
        mask = [0] * prompt + [1] * (length - prompt)
        logprobs = [0.0] * prompt + (rng.normal(-6.0, 0.5, size=length - prompt)).tolist()
        advantage = float("nan") if nan else float(rng.choice([-1.0, 1.0]))
        samples.append(pack_sample(f"s{i}", f"g{i // 2}", tokens, mask, logprobs, advantage=advantage,
                                   reward=1.0))
    return make_batch(step, algorithm, samples)
