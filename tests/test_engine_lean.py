"""The CPU engine's lean decode forward (remote/programs/lean_decode.py) gives what transformers' forward gives: the
same tokens and logprobs through prefill, decode steps, rows that finish and leave the batch, newcomers that join
it, and a weight update; a model it is not written for keeps transformers' forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the engine needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="the engine needs transformers")

from swectl.engine.wire import SamplingParams  # noqa: E402
from swectl.remote.programs.engine_batch import Model, Seq, join, prefill, step  # noqa: E402
from swectl.remote.programs.lean_decode import LeanDecode  # noqa: E402

SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(tiny_tokenizer), tie_word_embeddings=True, **SHAPE)
    net = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # weights large enough that rounding differences would show in the sampled tokens
        for p in net.parameters():
            p.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("qwen3")
    net.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def _seq(rid: int, prompt: list[int], max_new: int) -> Seq:
    return Seq(rid=str(rid), prompt=prompt, params=SamplingParams(max_new_tokens=max_new, temperature=1.0),
               return_logprob=True, max_new=max_new, stop_ids=frozenset(), stop_strs=(),
               generator=torch.Generator().manual_seed(rid))


def _generate(model: Model) -> list[tuple[list[int], list[float]]]:
    """Rows of different prompt lengths (left padding) and lengths (rows leave the batch), a newcomer joining
    midway; every row's tokens and logprobs."""
    first = [_seq(i, [(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)], max_new=8 + 6 * i) for i in range(3)]
    late = _seq(3, [11, 12, 13, 14], max_new=20)
    batch = prefill(model, first)
    for n in range(40):
        if n == 5:
            batch = join(model, batch, [late])
        step(model, batch)
        if not batch.seqs:
            break
    return [(s.output, s.logprobs) for s in [*first, late]]


def test_lean_decode_gives_transformers_tokens_and_logprobs(qwen3_folder: Path) -> None:
    lean = Model(qwen3_folder, attn_implementation="sdpa", decode="lean")
    plain = Model(qwen3_folder, attn_implementation="sdpa", decode="transformers")
    assert lean.lean is not None and plain.lean is None
    ours, theirs = _generate(lean), _generate(plain)
    assert all(len(tokens) > 5 for tokens, _ in ours)
    for (tokens, logprobs), (their_tokens, their_logprobs) in zip(ours, theirs, strict=True):
        assert tokens == their_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, their_logprobs, strict=True)) < 1e-4


def test_lean_decode_follows_a_weight_update(qwen3_folder: Path) -> None:
    """The fused projections are copies: a weight update must reach them."""
    lean = Model(qwen3_folder, attn_implementation="sdpa", decode="lean")
    plain = Model(qwen3_folder, attn_implementation="sdpa", decode="transformers")
    before = _generate(lean)
    generator = torch.Generator().manual_seed(1)
    update = [(name, torch.randn(p.shape, generator=generator) * 0.3) for name, p in lean.net.named_parameters()
              if "proj" in name]
    for model in (lean, plain):
        model.load_tensors(update)
    after = _generate(lean)
    assert [t for t, _ in after] == [t for t, _ in _generate(plain)]
    assert [t for t, _ in after] != [t for t, _ in before]


def test_a_model_it_is_not_written_for_keeps_transformers_forward() -> None:
    said: list[str] = []
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=300, **SHAPE))
    assert LeanDecode.build(llama, said.append) is None
    assert said == ["decode: transformers' forward (architecture LlamaForCausalLM)"]
    sliding = transformers.Qwen3Config(vocab_size=300, layer_types=["full_attention", "sliding_attention"],
                                       use_sliding_window=True, sliding_window=16, **SHAPE)
    assert LeanDecode.build(transformers.Qwen3ForCausalLM(sliding), said.append) is None
    assert said[-1] == "decode: transformers' forward (sliding-window layers)"


def _generate_with_joins(model: Model) -> tuple[list[tuple[list[int], list[float]]], list[bool]]:
    """Rows leaving from the middle of the batch and three joins: the first merges (the first batch has no spare
    rows), the later ones (a newcomer wider than the batch, then a narrower one) can go in place. Every row's tokens
    and logprobs, and whether each join kept the batch (in place)."""
    first = [_seq(i, [(5 * i + j) % 150 + 3 for j in range(6 + 7 * i)], max_new=30 - 7 * i) for i in range(4)]
    late = {4: _seq(10, [9, 8, 7], max_new=12), 7: _seq(11, [(3 * j) % 90 + 5 for j in range(45)], max_new=15),
            9: _seq(12, [21, 22, 23, 24], max_new=9)}
    batch = prefill(model, first)
    in_place: list[bool] = []
    for n in range(60):
        if n in late:
            joined = join(model, batch, [late[n]])
            in_place.append(joined is batch)
            batch = joined
        step(model, batch)
        if not batch.seqs:
            break
    return [(s.output, s.logprobs) for s in [*first, *late.values()]], in_place


def test_in_place_joins_and_leaves_give_what_the_concatenating_cache_gives(qwen3_folder: Path) -> None:
    """The in-place cache (newcomers written into spare rows and left room, leavers' slots taken by the last rows)
    against transformers' concatenating cache, whose joins and leaves stack and select every row."""
    ours, in_place = _generate_with_joins(Model(qwen3_folder, attn_implementation="sdpa", decode="lean"))
    theirs, _ = _generate_with_joins(Model(qwen3_folder, attn_implementation="sdpa", kv_cache="concat",
                                           decode="transformers"))
    assert in_place == [False, True, True]
    for (tokens, logprobs), (their_tokens, their_logprobs) in zip(ours, theirs, strict=True):
        assert tokens == their_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, their_logprobs, strict=True)) < 1e-4
