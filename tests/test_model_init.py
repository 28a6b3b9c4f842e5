"""`swectl model init`: a tiny Qwen3 model and a byte-level BPE tokenizer made locally, reloaded through the
public transformers API from the folder alone."""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

import msgspec
import pytest

for _module in ("torch", "transformers", "tokenizers", "safetensors"):
    pytest.importorskip(_module, reason=f"{_module} is not installed (pip install 'swectl[cpu]')")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from swectl.cli import model as model_cli  # noqa: E402
from swectl.errors import ConfigError  # noqa: E402
from swectl.model.tiny import (  # noqa: E402
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    PROVENANCE_FILE,
    ModelInitConfig,
    ModelInitError,
    ModelProvenance,
    build_model,
    count_parameters,
    init_model,
    load_provenance,
    read_corpus,
)

SMALL = ModelInitConfig(vocab_size=1024, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        seed=7, corpus_max_bytes=300_000)

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant that can interact with a computer."},
    {"role": "user", "content": "Fix the bug in `parse()`; the tests are in tests/.\n"},
    {"role": "assistant", "content": "THOUGHT: look first.\n\n```bash\nls -la\n```"},
    {"role": "user", "content": "<returncode>0</returncode>\n<output>\nsetup.py  src  tests — ok ✓\n</output>"},
    {"role": "assistant", "content": "THOUGHT: done.\n\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"},
]


def expected_parameters(cfg: ModelInitConfig) -> int:
    """Qwen3 parameter count written out from the architecture, independently of the model code."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = h * q + 2 * h * kv + q * h + 2 * cfg.head_dim  # q, k, v, o projections; q_norm and k_norm
    mlp = 3 * h * cfg.intermediate_size  # gate, up, down
    layer = attention + mlp + 2 * h  # input and post-attention RMSNorm
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    return embeddings + cfg.num_hidden_layers * layer + h  # final norm


def _quiet(_: str) -> None:
    pass


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    info = init_model(out, SMALL, progress=_quiet)
    assert info.path == str(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(made: Path):
    return AutoTokenizer.from_pretrained(made, local_files_only=True)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_folder_is_a_hugging_face_model_with_provenance(made: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", PROVENANCE_FILE):
        assert (made / name).is_file(), name
    assert not [p for p in made.parent.iterdir() if p.name.startswith(".")], "staging folders left behind"
    prov = load_provenance(made)
    assert prov.config == SMALL
    assert prov.special_tokens == {ENDOFTEXT: 0, IM_START: 1, IM_END: 2}
    assert 0 < prov.corpus.bytes <= SMALL.corpus_max_bytes
    assert prov.tokenizer_vocab_size <= SMALL.vocab_size
    config = json.loads((made / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == SMALL.rope_theta  # 4.x and 5.x
    generation = json.loads((made / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]
    assert generation["pad_token_id"] == 0


def test_reload_and_generate(made: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(made, local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.num_hidden_layers == SMALL.num_hidden_layers
    assert model.config.vocab_size == SMALL.vocab_size
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    input_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(input_ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (1, input_ids.shape[1] + 4)
    assert torch.equal(out[0, : input_ids.shape[1]], input_ids[0])
    assert int(out.max()) < SMALL.vocab_size


def test_special_tokens(tokenizer) -> None:
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token == ENDOFTEXT
    assert tokenizer.bos_token == ENDOFTEXT
    for i, token in enumerate((ENDOFTEXT, IM_START, IM_END)):
        assert tokenizer.encode(token, add_special_tokens=False) == [i]
    assert tokenizer.encode("hello", add_special_tokens=True) == tokenizer.encode("hello", add_special_tokens=False)
    assert tokenizer.decode([1, *tokenizer.encode("hi", add_special_tokens=False), 2], skip_special_tokens=True) == "hi"


def _random_text(rng: random.Random, length: int) -> str:
    chars = []
    while len(chars) < length:
        cp = rng.choice((rng.randrange(0x20, 0x7F), rng.randrange(0, 0x800), rng.randrange(0, 0x110000)))
        if not 0xD800 <= cp <= 0xDFFF:  # surrogates are not text
            chars.append(chr(cp))
    return "".join(chars)


def test_tokenizer_round_trips_any_text(tokenizer) -> None:
    rng = random.Random(1234)
    samples = [
        "", " ", "  leading and trailing  ", "def f(x):\r\n\treturn x  # ok\n",
        "naïve café — “quotes” ½ ∑ 日本語テキスト 한국어 العربية עברית 🐍🎉👩‍💻",
        "e\u0301 combining, \u200b zero width, \x00 nul, \x1b[31m escape",
        "<|im_start|>user\nhi<|im_end|>\n",
        *(_random_text(rng, rng.randrange(1, 200)) for _ in range(200)),
    ]
    for text in samples:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert all(0 <= i < len(tokenizer) for i in ids)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text, repr(text)


def test_tokenizer_learned_merges_from_code(tokenizer) -> None:
    text = "def __init__(self):\n        return self\n"
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text.encode()) / 2


def test_chat_template_renders_chatml(tokenizer) -> None:
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U\nline 2"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU\nline 2<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(messages[:1], tokenize=False) == "<|im_start|>system\nS<|im_end|>\n"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_chat_template_is_append_only(tokenizer) -> None:
    def render(messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    for k in range(1, len(CONVERSATION)):
        shorter, longer = render(CONVERSATION[:k]), render(CONVERSATION[: k + 1])
        assert longer.startswith(shorter), k
        assert ids(longer)[: len(ids(shorter))] == ids(shorter), k  # also as tokens, which is what the agent keeps
        if CONVERSATION[k]["role"] == "assistant":
            prompt = render(CONVERSATION[:k], generation_prompt=True)
            assert longer.startswith(prompt), k
            assert ids(longer)[: len(ids(prompt))] == ids(prompt), k


def test_parameter_count_matches_config(made: Path) -> None:
    prov = load_provenance(made)
    assert prov.parameters == expected_parameters(SMALL)
    model = AutoModelForCausalLM.from_pretrained(made, local_files_only=True)
    assert count_parameters(model) == expected_parameters(SMALL)
    untied = msgspec.structs.replace(SMALL, tie_word_embeddings=False, num_hidden_layers=1)
    assert count_parameters(build_model(untied, {ENDOFTEXT: 0, IM_START: 1, IM_END: 2})) == expected_parameters(untied)
    assert expected_parameters(ModelInitConfig()) == 1_836_416


def test_same_seed_same_model_and_tokenizer(made: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    init_model(again, SMALL, progress=_quiet)
    first, second = _weights(made), _weights(again)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert (made / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (made / PROVENANCE_FILE).read_bytes() == (again / PROVENANCE_FILE).read_bytes()

    other = tmp_path / "other-seed"
    init_model(other, msgspec.structs.replace(SMALL, seed=SMALL.seed + 1), progress=_quiet)
    third = _weights(other)
    assert any(not torch.equal(first[name], third[name]) for name in first)
    assert load_provenance(other).tokenizer_sha256 == load_provenance(made).tokenizer_sha256


def test_init_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    build_model(msgspec.structs.replace(SMALL, num_hidden_layers=1), {ENDOFTEXT: 0, IM_START: 1, IM_END: 2})
    assert torch.equal(torch.rand(3), expected)


def test_refuses_to_overwrite(made: Path, tmp_path: Path) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ModelInitError, match="not empty"):
        init_model(busy, SMALL, progress=_quiet)
    with pytest.raises(ModelInitError, match=PROVENANCE_FILE):
        init_model(busy, SMALL, overwrite=True, progress=_quiet)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]

    model_dir = tmp_path / "model"
    shutil.copytree(made, model_dir)
    with pytest.raises(ModelInitError, match="not empty"):
        init_model(model_dir, SMALL, progress=_quiet)
    reseeded = msgspec.structs.replace(SMALL, seed=123)
    init_model(model_dir, reseeded, overwrite=True, progress=_quiet)
    assert load_provenance(model_dir).config.seed == 123
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    empty = tmp_path / "empty"
    empty.mkdir()
    init_model(empty, msgspec.structs.replace(SMALL, num_hidden_layers=1), progress=_quiet)
    assert (empty / "model.safetensors").is_file()


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        ModelInitConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelInitConfig(vocab_size=100)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ModelInitConfig(num_hidden_layers=0)
    raw = msgspec.json.encode(SMALL)
    assert msgspec.json.decode(raw, type=ModelInitConfig) == SMALL
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"hidden_sise": 3}', type=ModelInitConfig)


def test_corpus_is_sorted_capped_and_utf8_only(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "b.py").write_text("b = 'é'\n" * 10)
    (src / "a.py").write_text("a = 1\n" * 10)
    (src / "pkg" / "c.py").write_text("c = 3\n")
    (src / "latin1.py").write_bytes(b"x = '\xe9'\n")
    (src / "site-packages").mkdir()
    (src / "site-packages" / "third.py").write_text("third = 1\n")
    cfg = ModelInitConfig(corpus_globs=(str(src / "**" / "*.py"),), corpus_max_bytes=66)
    texts, info = read_corpus(cfg)
    assert texts == ["a = 1\n" * 10, "b = '"]  # 60 + 6 bytes: the cut falls inside 'é', which is dropped whole
    assert (info.files, info.bytes) == (2, 65)
    texts, info = read_corpus(msgspec.structs.replace(cfg, corpus_max_bytes=10_000))
    assert [t.splitlines()[0] for t in texts] == ["a = 1", "b = 'é'", "c = 3"]
    assert read_corpus(msgspec.structs.replace(cfg, corpus_max_bytes=10_000))[1] == info
    with pytest.raises(ConfigError, match="no readable"):
        read_corpus(ModelInitConfig(corpus_globs=(str(tmp_path / "nothing" / "*.py"),)))


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="swectl")
    model_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["model", "init", "--help"])
    assert exc.value.code == 0
    assert "--corpus" in capsys.readouterr().out

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "m.py").write_text("import os\n\n\ndef main():\n    print(os.getcwd())\n" * 50)
    out = tmp_path / "cli-model"
    args = parser.parse_args(["model", "init", "--out", str(out), "--layers", "1", "--hidden", "32", "--vocab", "300",
                              "--seed", "5", "--corpus", str(corpus / "*.py"), "--json"])
    assert model_cli.run(args) == 0
    printed = json.loads(capsys.readouterr().out)
    prov = msgspec.json.decode((out / PROVENANCE_FILE).read_bytes(), type=ModelProvenance)
    assert printed["parameters"] == prov.parameters == expected_parameters(prov.config)
    assert (prov.config.num_hidden_layers, prov.config.hidden_size, prov.config.intermediate_size) == (1, 32, 96)
    assert (prov.config.vocab_size, prov.config.seed, prov.corpus.files) == (300, 5, 1)
    with pytest.raises(ModelInitError):
        model_cli.run(args)
