"""Fast tokens: the tiktoken encoding built from a byte-level BPE gives the Hugging Face tokenizer's ids (the
oracle) on this repository's text, random unicode, whitespace runs, control characters and special-token-looking
text; tokenizers it cannot reproduce stay with HF, saying why; the wrapper builds the same trajectories."""

from __future__ import annotations

import copy
import json
import logging
import pickle
import random
import unicodedata
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("transformers", reason="needs the cpu extra (pip install 'swectl[cpu]')")
pytest.importorskip("tokenizers", reason="needs the cpu extra (pip install 'swectl[cpu]')")
pytest.importorskip("tiktoken", reason="needs the cpu extra (pip install 'swectl[cpu]')")

from swectl.agent.loop import _managed_prompt
from swectl.agent.trajectory import TrajectoryBuilder
from swectl.model.fast_tokens import (
    FastTokenizer,
    SegmentCache,
    build_encoding,
    fast_tokenizer,
    sample_corpus,
    tiktoken_encoding,
)
from swectl.model.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS

REPO = Path(__file__).resolve().parents[1]
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
LLAMA3_PATTERN = QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

MULTILINGUAL = ("naïve café “quotes” — Straße ÆØÅ ĳ Œ\n中文的文本，测试一下。日本語のテキストです。한국어 문장입니다.\n"
                "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया। สวัสดีชาวโลก\n"
                "emoji 😀👍🏽👨‍👩‍👧🇩🇪 ✔️ math 𝔘𝔫𝔦 ∑∫√∞ ≤≥ ½ ² ٣٤٥ १२३\n")


# -- text ----------------------------------------------------------------------------------------------------------


def repo_texts() -> list[str]:
    """This repository's own source, docs and configs: a few MB of code, prose and tables."""
    paths = [p for top in ("swectl", "tests", "actors", "remote", "benchmarks", "experiments", "examples", "scripts")
             for p in sorted((REPO / top).rglob("*")) if p.is_file() and p.suffix in (".py", ".md", ".toml", ".sh",
                                                                                      ".txt", ".json", ".yaml")]
    paths += [REPO / "README.md", REPO / "pyproject.toml", REPO / "justfile"]
    texts = []
    for p in paths:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return texts


_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
              "\u2028\u2029\u202f\u205f\u3000\u200b\u200c\u200d\u2060\ufeff\u180e"
_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    _WHITESPACE,
    "'sStTdDmMlLvVrReE",  # contractions, in any case
    "".join(chr(c) for c in range(0x300, 0x370)),  # combining marks
    "àáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿĀāĂăĄąĆćĈĉŉſƀǄǅǆǱ",
    "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΩабвгдежзийклмнопрстуфхцчшщъыьэюяЁЖЩ",
    "אבגדהוזחטיכלמנסעפצקרשת" + "ابتثجحخدذرزسشصضطظعغفقكلمنهوي" + "٠١٢٣٤٥٦٧٨٩",
    "कखगघङचछजझञटठडढणतथदधनपफबभमयरलवशषसह" + "ािीुूृेैोौं्" + "०१२३४५६७८९",
    "一二三四五六七八九十中文字测试日本語漢字かなカナひらがなー。、「」" + "가나다라마바사아자차카타파하한글",
    "กขฃคฅฆงจฉชซฌญฎฏฐฑฒณดตถทธนบปผฝพฟภมยรลวศษสหฬอฮ" + "ัิีึืุู่้๊๋",
    "😀😁😂🤣👍🏽🏻🏿👨‍👩‍👧‍👦🇩🇪🇯🇵❤️✔️☃️⌚️🀄🂡",
    "\x00\x01\x02\x07\x08\x1b\x7f\x80\x9f\ufffd\ue000\U000f0000\U0010fffd",
    "ℌℍℎℏℐℑ𝔘𝔫𝔦𝔠𝔬𝔡𝔢𝟘𝟙𝟚Ⅰ Ⅱ Ⅻ ①②③ ½¼¾ ²³¹ ﬁﬂ ﬀ",
]


def random_code_point(rng: random.Random) -> str:
    while True:
        c = rng.randrange(0x110000) if rng.random() < 0.3 else rng.randrange(0x3000)
        if not 0xD800 <= c <= 0xDFFF:
            return chr(c)


def random_text(rng: random.Random, n: int) -> str:
    out: list[str] = []
    while len(out) < n:
        if rng.random() < 0.15:
            out.append(random_code_point(rng))
            continue
        pool = rng.choice(_POOLS)
        out.extend(rng.choice(pool) for _ in range(rng.randint(1, 12)))
    return "".join(out)


def assert_same_ids(hf: Any, fast: FastTokenizer, texts: list[str]) -> None:
    for i, text in enumerate(texts):
        want = hf.encode(text, add_special_tokens=False)
        got = fast.encode(text, add_special_tokens=False)
        assert got == want, f"text {i} ({text[:80]!r}...): tiktoken and HF ids differ"
        assert fast.count(text) == len(want)


# -- tokenizers made here -----------------------------------------------------------------------------------------


def bpe_tokenizer(texts: list[str], *, vocab_size: int = 1500, normalizer: Any = None, pre_tokenizer: Any = None,
                  model: Any = None) -> Any:
    """A BPE trained on ``texts`` with the tiny model's special tokens and ChatML template, as transformers has it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(model or models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def split_then_byte_level(pattern: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def from_json(spec: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   clean_up_tokenization_spaces=False)


def spec_of(hf: Any) -> dict[str, Any]:
    return json.loads(hf.backend_tokenizer.to_str())


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return repo_texts()


@pytest.fixture(scope="module")
def training_texts(corpus: list[str]) -> list[str]:
    rng = random.Random(7)
    return corpus[:150] + [MULTILINGUAL] * 50 + [random_text(rng, 400) for _ in range(200)]


@pytest.fixture(scope="module")
def qwen_like(training_texts: list[str]) -> Any:
    """Qwen's shape: NFC normalizer, Split(Qwen 2 regex, Isolated) then ByteLevel without a regex, and two
    non-special added tokens as Qwen has for tool calls."""
    from tokenizers import normalizers

    hf = bpe_tokenizer(training_texts, vocab_size=3000, normalizer=normalizers.NFC(),
                       pre_tokenizer=split_then_byte_level(QWEN2_PATTERN))
    hf.add_tokens(["<tool_call>", "</tool_call>"])
    return hf


@pytest.fixture(scope="module")
def fast_tiny(tiny_tokenizer: Any) -> FastTokenizer:
    fast = fast_tokenizer(tiny_tokenizer)
    assert isinstance(fast, FastTokenizer)
    return fast


# -- ids equal HF -------------------------------------------------------------------------------------------------


def test_tiny_tokenizer_ids_equal_hf_on_this_repository(tiny_tokenizer: Any, fast_tiny: FastTokenizer,
                                                       corpus: list[str]) -> None:
    assert sum(len(t) for t in corpus) > 1_000_000
    texts = corpus + sample_corpus() + ["\n\n".join(corpus[:40])]
    assert_same_ids(tiny_tokenizer, fast_tiny, texts)


def test_tiny_tokenizer_ids_equal_hf_on_random_unicode(tiny_tokenizer: Any, fast_tiny: FastTokenizer) -> None:
    rng = random.Random(1)
    texts = [random_text(rng, rng.randint(0, 300)) for _ in range(3000)]
    texts += [random_text(rng, 20_000) for _ in range(3)]
    assert_same_ids(tiny_tokenizer, fast_tiny, texts)


def test_whitespace_runs_and_control_characters(tiny_tokenizer: Any, fast_tiny: FastTokenizer) -> None:
    rng = random.Random(2)
    texts = [" " * 10_000, "\n" * 5_000, "\t" * 3_000, "\r\n" * 2_000, "x" + " " * 5_000 + "y", "y" + " " * 4_999,
             " " * 4_999 + "\n", "\u3000" * 1_000 + "z", "\xa0 " * 1_000, "a" * 50_000, "=" * 20_000, "7" * 9_999,
             "".join(rng.choice(" \t\n\r\x0b\x0c\xa0\u2028") for _ in range(20_000)),
             "".join(chr(c) for c in range(0x100)) * 20]
    assert_same_ids(tiny_tokenizer, fast_tiny, texts)


def test_text_from_bytes_that_are_not_utf8(tiny_tokenizer: Any, fast_tiny: FastTokenizer) -> None:
    rng = random.Random(3)
    blobs = [bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))) for _ in range(300)]
    blobs += ["caf\xe9 \u00e9 ok".encode("latin-1", errors="replace"), b"\xff\xfe\x00a\xc3(\xed\xa0\x80"]
    replaced = [b.decode("utf-8", errors="replace") for b in blobs]
    assert_same_ids(tiny_tokenizer, fast_tiny, replaced)
    # Lone surrogates (errors="surrogateescape") are refused by HF; the wrapper hands them to HF, which says so.
    escaped = [t for t in (b.decode("utf-8", errors="surrogateescape") for b in blobs) if not t.isascii()]
    for text in escaped[:50]:
        with pytest.raises(TypeError) as from_hf:
            tiny_tokenizer.encode(text, add_special_tokens=False)
        with pytest.raises(TypeError) as from_fast:
            fast_tiny.encode(text, add_special_tokens=False)
        assert str(from_fast.value) == str(from_hf.value)


def test_special_tokens_in_text_are_encoded_as_hf_encodes_them(tiny_tokenizer: Any, fast_tiny: FastTokenizer) -> None:
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = "output: <|im_end|>\n<|im_start|>user\nfake turn<|endoftext|> <|im_end <|IM_END|>"
    want = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert end in want  # HF's encode maps added tokens in the text to their ids; add_special_tokens is unrelated
    assert fast_tiny.encode(text, add_special_tokens=False) == want
    assert fast_tiny.encode(text) == tiny_tokenizer.encode(text)  # add_special_tokens=True: no post-processor tokens


def test_split_special_tokens_makes_them_text_in_both(training_texts: list[str]) -> None:
    hf = bpe_tokenizer(training_texts[:100], vocab_size=800)
    hf.split_special_tokens = True
    fast = fast_tokenizer(hf)
    assert isinstance(fast, FastTokenizer)
    text = "a <|im_end|> b <|endoftext|>"
    assert hf.convert_tokens_to_ids("<|im_end|>") not in hf.encode(text, add_special_tokens=False)
    assert_same_ids(hf, fast, [text, *sample_corpus()])
    hf.split_special_tokens = False  # changed after the wrapper was made: those calls go to HF
    assert_same_ids(hf, fast, [text])


def test_qwen_shaped_tokenizer_nfc_split_regex_and_added_tokens(qwen_like: Any, corpus: list[str]) -> None:
    fast = fast_tokenizer(qwen_like)
    assert isinstance(fast, FastTokenizer), build_encoding(qwen_like)[1]
    rng = random.Random(4)
    decomposed = [unicodedata.normalize("NFD", MULTILINGUAL), "cafe\u0301 <|im_end|>\u0338 >\u0338 A\u030a"]
    texts = corpus[:200] + [random_text(rng, rng.randint(0, 300)) for _ in range(2000)] + decomposed
    texts += ["<tool_call>{\"name\": \"bash\"}</tool_call> <tool_call", MULTILINGUAL * 20]
    assert_same_ids(qwen_like, fast, texts)


def test_llama3_split_regex(training_texts: list[str]) -> None:
    hf = bpe_tokenizer(training_texts, vocab_size=2000, pre_tokenizer=split_then_byte_level(LLAMA3_PATTERN))
    fast = fast_tokenizer(hf)
    assert isinstance(fast, FastTokenizer), build_encoding(hf)[1]
    rng = random.Random(5)
    assert_same_ids(hf, fast, [random_text(rng, rng.randint(0, 200)) for _ in range(1000)] + sample_corpus())


def test_a_saved_tokenizer_folder_loads_wrapped(tiny_tokenizer: Any, tmp_path: Path) -> None:
    from swectl.model.tokenizer import load_tokenizer

    tiny_tokenizer.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path), "--tokenizer")
    assert isinstance(tok, FastTokenizer)
    text = "THOUGHT: list\n```bash\nls -la\n```<|im_end|>"
    assert tok.encode(text, add_special_tokens=False) == tiny_tokenizer.encode(text, add_special_tokens=False)


# -- fallbacks ----------------------------------------------------------------------------------------------------


def test_wordpiece_stays_with_hf(training_texts: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(training_texts[:50], trainer=trainers.WordPieceTrainer(
        vocab_size=500, special_tokens=["[UNK]"], show_progress=False))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    encoding, reason = build_encoding(hf)
    assert encoding is None
    assert "model WordPiece (not BPE)" in reason
    assert fast_tokenizer(hf) is hf


@pytest.mark.parametrize(("make", "reason"), [
    ("lowercase", "normalizer Lowercase"),
    ("nfkc", "normalizer NFKC"),
    ("metaspace", "pre-tokenizer Metaspace"),
    ("prefix_space", "add_prefix_space"),
    ("whitespace_split", "pre-tokenizer WhitespaceSplit"),
])
def test_bpe_that_tiktoken_cannot_reproduce_stays_with_hf(make: str, reason: str, training_texts: list[str]) -> None:
    from tokenizers import normalizers, pre_tokenizers

    kw: dict[str, Any] = {
        "lowercase": {"normalizer": normalizers.Lowercase()},
        "nfkc": {"normalizer": normalizers.NFKC()},
        "metaspace": {"pre_tokenizer": pre_tokenizers.Metaspace()},
        "prefix_space": {"pre_tokenizer": pre_tokenizers.ByteLevel(add_prefix_space=True)},
        "whitespace_split": {"pre_tokenizer": pre_tokenizers.WhitespaceSplit()},
    }[make]
    hf = bpe_tokenizer(training_texts[:60], vocab_size=700, **kw)
    encoding, why = build_encoding(hf)
    assert encoding is None
    assert reason in why
    assert fast_tokenizer(hf) is hf


def test_merge_order_that_is_not_id_order(tiny_tokenizer: Any) -> None:
    spec = spec_of(tiny_tokenizer)
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    first, last = ("".join(merges[0]), "".join(merges[-1]))
    vocab[first], vocab[last] = vocab[last], vocab[first]
    encoding, why = build_encoding(from_json(spec))
    assert encoding is None
    assert "merge order is not id order" in why


def _alphabet_spec(merges: list[list[str]], extra_vocab: tuple[str, ...] = ()) -> dict[str, Any]:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["".join(m) for m in merges] + list(extra_vocab)
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "post_processor": None, "decoder": None,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges}}


def test_a_token_that_hf_never_makes_as_a_whole_word() -> None:
    # "abc" comes from (a, bc), but HF merges (a, b) first and ends at [ab, c]; tiktoken would emit "abc" whole.
    hf = from_json(_alphabet_spec([["a", "b"], ["b", "c"], ["a", "bc"]]))
    assert hf.encode("abc", add_special_tokens=False) == [hf.convert_tokens_to_ids("ab"), hf.convert_tokens_to_ids("c")]
    encoding, why = build_encoding(hf)
    assert encoding is None
    assert "'abc'" in why and "as a whole word" in why


def test_a_vocab_token_no_merge_makes() -> None:
    encoding, why = build_encoding(from_json(_alphabet_spec([["a", "b"]], extra_vocab=("xyz",))))
    assert encoding is None
    assert "neither bytes, merge results nor added tokens (e.g. 'xyz')" in why


def test_a_consistent_hand_made_bpe_is_accepted() -> None:
    hf = from_json(_alphabet_spec([["a", "b"], ["b", "c"], ["ab", "c"], ["Ġ", "ab"]]))
    fast = fast_tokenizer(hf)
    assert isinstance(fast, FastTokenizer)
    assert_same_ids(hf, fast, ["abc ab abcabc bcab", *sample_corpus()])


def test_ids_that_differ_on_the_sample_corpus_keep_hf(training_texts: list[str],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    # A split regex that does not cover every character: HF keeps the gaps as pieces, tiktoken drops them.
    hf = bpe_tokenizer(training_texts[:60], vocab_size=700, pre_tokenizer=split_then_byte_level(r"\p{L}+"))
    with caplog.at_level(logging.INFO, logger="swectl.model.fast_tokens"):
        assert tiktoken_encoding(hf) is None
    assert any(r.levelno == logging.WARNING and "ids differ from HF" in r.getMessage() for r in caplog.records)


def test_not_a_fast_tokenizer() -> None:
    encoding, why = build_encoding(object())
    assert encoding is None
    assert "no tokenizers backend" in why


# -- the wrapper in use -------------------------------------------------------------------------------------------


def engine_output(tok: Any, text: str) -> tuple[list[int], list[float]]:
    ids = [*tok.encode(text, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    rng = random.Random(len(ids))
    return ids, [-rng.random() for _ in ids]


def build_trajectory(tok: Any, observations: list[str]) -> dict[str, Any]:
    b = TrajectoryBuilder(tok)
    b.start("You are an agent. <|im_end|> is how a turn ends.", "Fix the bug in f(). Ünïcode ok")
    for n, obs in enumerate(observations):
        ids, lps = engine_output(tok, f"THOUGHT: step {n} ü€\n```bash\ncat f{n}.py | head -n 40\n```")
        b.add_output(ids, lps, weight_version=f"v{n}")
        b.add_observation(obs)
    b.traj.check()
    return msgspec.to_builtins(b.traj)


def test_the_wrapper_builds_the_same_trajectories(tiny_tokenizer: Any, fast_tiny: FastTokenizer,
                                                  corpus: list[str]) -> None:
    rng = random.Random(6)
    observations = [f"<returncode>0</returncode>\n<output>\n{text[:8000]}\n</output>" for text in corpus[:25]]
    observations += [random_text(rng, 2000), "<returncode>1</returncode>\n<output>\n<|im_end|>\n</output>",
                     "x" + " " * 3000, unicodedata.normalize("NFD", MULTILINGUAL), ""]
    assert build_trajectory(fast_tiny, observations) == build_trajectory(tiny_tokenizer, observations)


def test_managed_context_counts_and_renders_the_same(tiny_tokenizer: Any, fast_tiny: FastTokenizer,
                                                     corpus: list[str]) -> None:
    observations = [f"<output>\n{text[:3000]}\n</output>" for text in corpus[:12]]
    views = []
    for tok in (tiny_tokenizer, fast_tiny):
        b = TrajectoryBuilder(tok)
        b.start("system", "problem")
        for n, obs in enumerate(observations):
            b.add_output(*engine_output(tok, f"THOUGHT: {n}\n```bash\nls\n```"), weight_version="v")
            b.add_observation(obs)
        views.append(_managed_prompt(b, tok, 2000))
    assert views[0] == views[1]
    assert views[1][1] > 0  # turns were omitted: the budget was exercised


def test_the_wrapper_is_the_hf_tokenizer_for_everything_else(tiny_tokenizer: Any, fast_tiny: FastTokenizer) -> None:
    assert fast_tiny.eos_token_id == tiny_tokenizer.eos_token_id
    assert len(fast_tiny) == len(tiny_tokenizer)
    assert fast_tiny("a b")["input_ids"] == tiny_tokenizer("a b")["input_ids"]
    ids = fast_tiny.encode("héllo <|im_end|>", add_special_tokens=False)
    assert fast_tiny.decode(ids) == tiny_tokenizer.decode(ids) == "héllo <|im_end|>"
    conv = [{"role": "user", "content": "hi"}]
    rendered = tiny_tokenizer.apply_chat_template(conv, tokenize=False)
    assert fast_tiny.apply_chat_template(conv, tokenize=False) == rendered
    # Settings written through the wrapper are the HF tokenizer's.
    fast_tiny.chat_template = "{{ messages[0]['content'] }}!"
    try:
        assert tiny_tokenizer.apply_chat_template(conv, tokenize=False) == "hi!"
        assert "chat_template" not in vars(fast_tiny)
    finally:
        tiny_tokenizer.chat_template = CHAT_TEMPLATE
    # Other keyword arguments go to HF as they are.
    assert fast_tiny.encode("a b c", add_special_tokens=False, max_length=2, truncation=True) == \
        tiny_tokenizer.encode("a b c", add_special_tokens=False, max_length=2, truncation=True)
    for clone in (pickle.loads(pickle.dumps(fast_tiny)), copy.deepcopy(fast_tiny)):
        assert isinstance(clone, FastTokenizer)
        assert clone.encode("x = 1 <|im_end|>", add_special_tokens=False) == \
            tiny_tokenizer.encode("x = 1 <|im_end|>", add_special_tokens=False)


TOOLS_TEMPLATE = (
    "{%- if tools -%}<|im_start|>system\n# Tools\n{%- for t in tools -%}\n{{ t | tojson }}{%- endfor -%}"
    "<|im_end|>\n{%- endif -%}"
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{%- for c in m.get('tool_calls', []) -%}\n<tool_call>\n{{ c | tojson }}\n</tool_call>{%- endfor -%}"
    "<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


def test_tokenized_chat_templates_give_hf_ids(tiny_tokenizer: Any, fast_tiny: FastTokenizer, qwen_like: Any,
                                             corpus: list[str]) -> None:
    """apply_chat_template(tokenize=True) renders with HF and encodes through tiktoken: the ids HF's own call makes,
    as the mapping HF returns by default or the list (return_dict=False), with tools, special-token-looking text
    in the messages and text NFC would change; arguments that change HF's tokenizer call go to HF whole."""
    rng = random.Random(7)
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    before, qwen_like.chat_template = qwen_like.chat_template, TOOLS_TEMPLATE
    fast_qwen = fast_tokenizer(qwen_like)
    assert isinstance(fast_qwen, FastTokenizer)
    for n in range(60):
        conv = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": corpus[n][:3000]}]
        for _ in range(rng.randint(0, 4)):
            conv += [{"role": "assistant", "content": random_text(rng, 200),
                      "tool_calls": [{"name": "bash", "arguments": {"command": "ls <|im_end|>"}}]},
                     {"role": "user", "content": rng.choice([unicodedata.normalize("NFD", MULTILINGUAL),
                                                             "<|im_end|>\n<|im_start|>user\nfake", corpus[-n][:2000]])}]
        generation = n % 2 == 0
        for hf, fast in ((tiny_tokenizer, fast_tiny), (qwen_like, fast_qwen)):
            kw: dict[str, Any] = {"add_generation_prompt": generation}
            if hf is qwen_like and n % 3:
                kw["tools"] = tools
            want = hf.apply_chat_template(conv, tokenize=True, **kw)
            got = fast.apply_chat_template(conv, tokenize=True, **kw)
            assert got["input_ids"] == list(want["input_ids"])
            assert got["attention_mask"] == list(want["attention_mask"])
            assert fast.apply_chat_template(conv, return_dict=False, **kw) == \
                hf.apply_chat_template(conv, return_dict=False, **kw)
    conv = [{"role": "user", "content": "a b c d e f"}]
    truncated = fast_tiny.apply_chat_template(conv, truncation=True, max_length=3, return_dict=False)
    assert truncated == tiny_tokenizer.apply_chat_template(conv, truncation=True, max_length=3, return_dict=False)
    assert len(truncated) == 3
    batch = [conv, conv + conv]
    assert fast_tiny.apply_chat_template(batch, return_dict=False) == \
        tiny_tokenizer.apply_chat_template(batch, return_dict=False)
    qwen_like.chat_template = before


def test_a_history_rendered_turn_by_turn_reuses_its_segments(tiny_tokenizer: Any, fast_tiny: FastTokenizer,
                                                             corpus: list[str]) -> None:
    """Each turn re-renders the whole history (as a harness sends it): the earlier messages' pieces come from the
    segment cache, the ids stay HF's, including a history rewritten in its middle."""
    conv = [{"role": "system", "content": "sys"}, {"role": "user", "content": corpus[3][:4000]}]
    for n in range(12):
        conv += [{"role": "assistant", "content": f"THOUGHT: {n}\n```bash\nls\n```"},
                 {"role": "user", "content": corpus[10 + n][:3000]}]
        if n == 6:
            conv[3] = {"role": "user", "content": "rewritten <|im_end|> observation"}
        before = len(fast_tiny._segments)
        assert fast_tiny.apply_chat_template(conv, return_dict=False, add_generation_prompt=True) == \
            tiny_tokenizer.apply_chat_template(conv, return_dict=False, add_generation_prompt=True)
        assert len(fast_tiny._segments) - before <= 3  # the new messages' pieces, not the history's


def test_the_segment_cache_holds_its_token_bound() -> None:
    calls: list[str] = []

    def encode(text: str) -> list[int]:
        calls.append(text)
        return list(range(len(text)))

    cache = SegmentCache(encode, max_tokens=10)
    assert cache.ids("abcd") == [0, 1, 2, 3]
    assert cache.ids("abcd") == [0, 1, 2, 3] and calls == ["abcd"]  # the second from the cache
    cache.ids("efghij")  # 4 + 6 = 10: both held
    cache.ids("kl")  # 12 > 10: the oldest ("abcd") goes
    assert len(cache) == 2
    cache.ids("abcd")
    assert calls.count("abcd") == 2
    cache.ids("x" * 11)  # longer than the bound: encoded, never held
    assert "x" * 11 not in cache._ids
