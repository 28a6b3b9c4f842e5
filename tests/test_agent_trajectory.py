"""Token-in/token-out trajectories with a real byte-level BPE tokenizer and ChatML template (from
`swectl model init`): engine tokens are kept exactly (mask 1, logprobs), observations are template tokens
(mask 0), and a template that rewrites history triggers a realignment that masks the lost tokens."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("transformers", reason="needs the cpu extra (pip install 'swectl[cpu]')")
pytest.importorskip("tokenizers", reason="needs the cpu extra (pip install 'swectl[cpu]')")

from swectl.agent.trajectory import TrajectoryBuilder


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return tiny_tokenizer


def engine_output(tok, text: str, *, close: bool = True) -> tuple[list[int], list[float]]:
    ids = tok.encode(text, add_special_tokens=False)
    if close:
        ids.append(tok.convert_tokens_to_ids("<|im_end|>"))
    rng = random.Random(len(ids))
    return ids, [-rng.random() * 3 for _ in ids]


def test_engine_tokens_kept_exactly_and_observations_masked(tok) -> None:
    b = TrajectoryBuilder(tok)
    ids = b.start("You are an agent.", "Fix the bug in f.")
    assert ids == b.traj.token_ids
    assert b.traj.prompt_length == len(ids)
    assert not any(b.traj.loss_mask)
    outputs = []
    for turn in range(4):
        out_ids, lps = engine_output(tok, f"THOUGHT: step {turn} ü€\n```bash\nls -la /tmp/{turn}\n```")
        outputs.append((out_ids, lps))
        b.add_output(out_ids, lps, weight_version=f"v{turn}")
        ids = b.add_observation(f"<returncode>0</returncode>\n<output>\nfile{turn}.py\n</output>")
    t = b.traj
    t.check()
    masked = [i for i, m in enumerate(t.loss_mask) if m]
    assert [t.token_ids[i] for i in masked] == [x for o, _ in outputs for x in o]
    assert [t.logprobs[i] for i in masked] == [x for _, lp in outputs for x in lp]
    assert all(t.logprobs[i] == 0.0 for i, m in enumerate(t.loss_mask) if not m)
    assert t.realignments == 0
    assert t.weight_versions == ["v0", "v1", "v2", "v3"]
    # The tokens spell exactly what the chat template renders for the conversation.
    conv = [{"role": m.role, "content": m.content} for m in t.messages]
    assert tok.decode(ids) == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)


def test_output_cut_at_max_tokens_gets_the_end_token_from_the_template(tok) -> None:
    b = TrajectoryBuilder(tok)
    b.start("s", "u")
    out_ids, lps = engine_output(tok, "THOUGHT: I was cut", close=False)
    b.add_output(out_ids, lps, "v0")
    b.add_observation("obs")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    i = b.traj.prompt_length + len(out_ids)
    assert b.traj.token_ids[i] == end
    assert b.traj.loss_mask[i] == 0  # not emitted by the engine: not trained


def test_history_rewriting_template_is_realigned(tok, monkeypatch) -> None:
    # A template that hides earlier assistant turns (like reasoning-stripping templates): not append-only.
    monkeypatch.setattr(tok, "chat_template", (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}<|im_start|>assistant\n"
        "(earlier turn)<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ))
    b = TrajectoryBuilder(tok)
    b.start("s", "u")
    first, lp1 = engine_output(tok, "THOUGHT: one\n```bash\nls\n```")
    b.add_output(first, lp1, "v0")
    b.add_observation("obs one")
    assert b.traj.realignments == 1
    # The first turn's tokens are gone from the rendering; nothing mask-1 survives the rewrite.
    assert sum(b.traj.loss_mask) == 0
    second, lp2 = engine_output(tok, "THOUGHT: two")
    b.add_output(second, lp2, "v1")
    assert b.traj.token_ids[-len(second):] == second
    assert sum(b.traj.loss_mask) == len(second)
    b.traj.check()


def test_output_cut_inside_a_character_gives_the_same_tokens_as_a_whole_decode(tok) -> None:
    """Each step decodes only its new tokens; turns cut inside a UTF-8 character must still line up with
    the template's rendering (no realignment, every engine token kept)."""
    whole_ids = tok.encode("THOUGHT: 日本語 ü€ done", add_special_tokens=False)
    cut = next(i for i in range(1, len(whole_ids)) if "\ufffd" in tok.decode(whole_ids[:i]))
    b = TrajectoryBuilder(tok)
    b.start("s", "u")
    for turn in range(3):
        b.add_output(whole_ids[:cut], [0.0] * cut, f"v{turn}")
        b.add_observation(f"obs {turn} ü")
    assert b.traj.realignments == 0
    t = b.traj
    conv = [{"role": m.role, "content": m.content} for m in t.messages]
    assert tok.decode(t.token_ids) == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert sum(t.loss_mask) == 3 * cut
