"""Fast tokens on the hot path: a tiktoken ``Encoding`` built from the policy's own byte-level BPE.

The agent encodes every observation and counts tokens for the context budget; the Hugging Face tokenizer does that
through transformers' Python layers and the ``tokenizers`` pipeline. Where the policy's tokenizer is a byte-level
BPE that tiktoken can reproduce exactly (the tiny model's, GPT-2's, Qwen's), ``tiktoken_encoding`` builds an
``Encoding`` from its ``tokenizer.json`` (ranks = the HF ids) and ``FastTokenizer`` serves ``encode`` and
``count`` through it, with the HF tokenizer's ids as the oracle. Anything else stays with the HF tokenizer.

What tiktoken can reproduce, and how each condition is checked when the encoding is built:

- the model is a plain BPE (no dropout, no subword prefix or word suffix, no byte fallback) over the 256-character
  byte-level alphabet, every byte has a token, and every other regular token is the result of a merge;
- the merges' order is the order of their results' ids (tiktoken merges by the rank of the merged token, HF by the
  merge's index), and each merged token as a whole word encodes to itself in HF (tiktoken looks a whole piece up in
  its ranks before merging; HF merges unless ``ignore_merges``);
- the pre-tokenizer is ``ByteLevel`` with its GPT-2 regex, or ``Split(regex, Isolated)`` then ``ByteLevel``
  without a regex (Qwen, Llama 3), never adding a prefix space;
- no normalizer, or NFC alone (Qwen): text that NFC would change goes to the HF tokenizer, call by call;
- added tokens without lstrip/rstrip/single-word, none a prefix of another (HF matches the longest, tiktoken the
  first alternative) and none overlapping across HF's two passes (tokens matched before and after normalisation).

Then the wrapper's ids must equal the HF ids on a built-in sample corpus (code, logs, diffs, prose, many
scripts, whitespace runs, control characters, special-token-looking text); any difference keeps the HF tokenizer
and logs why. Both ``encode`` paths treat added tokens in the text as HF does in ``encode``: ``<|im_end|>`` in an
observation becomes the special token (``add_special_tokens`` only controls what a post-processor adds), unless
``split_special_tokens`` is set, in which case special tokens are ordinary text.

tiktoken and tokenizers are imported inside functions so that importing swectl stays fast.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import time
import unicodedata
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from swectl.errors import SwectlError

if TYPE_CHECKING:
    import tiktoken

_log = logging.getLogger(__name__)

# The split of tokenizers' ByteLevel pre-tokenizer with use_regex=True (GPT-2's).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

_SURROGATE = re.compile("[\ud800-\udfff]")
_PROBE = "probe: add_special_tokens"  # encoded with and without the post-processor's tokens


class _Unsupported(SwectlError):
    """This tokenizer is not one tiktoken reproduces; the message says why (control flow inside this module)."""


def byte_alphabet() -> dict[str, int]:
    """The byte-level alphabet of GPT-2 and HF ``ByteLevel``: character -> the byte it stands for. Printable
    Latin-1 bytes stand for themselves; the other 68 bytes, in order, for U+0100 onwards."""
    visible = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in visible:
            table[chr(byte)] = byte
        else:
            table[chr(0x100 + shifted)] = byte
            shifted += 1
    return table


# -- what the tokenizer.json says ---------------------------------------------------------------------------------


def _backend(hf: Any) -> Any:
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        raise _Unsupported(f"{type(hf).__name__} has no tokenizers backend (not a fast tokenizer)")
    return backend


def _is_nfc(normalizer: dict[str, Any] | None) -> bool:
    """False for no normalizer, True for NFC alone; anything else is unsupported."""
    if normalizer is None:
        return False
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    kinds = [s.get("type") for s in steps]
    if not kinds:
        return False
    if kinds == ["NFC"]:
        return True
    raise _Unsupported(f"normalizer {'+'.join(str(k) for k in kinds)} (only none or NFC can be reproduced)")


def _check_byte_level(step: dict[str, Any]) -> None:
    if step.get("add_prefix_space"):
        raise _Unsupported("ByteLevel pre-tokenizer with add_prefix_space")


def _split_pattern(pre: dict[str, Any] | None) -> str:
    """The regex that cuts text into pieces, from the pre-tokenizer config."""
    if pre is None:
        raise _Unsupported("no pre-tokenizer (not a byte-level BPE)")
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"]:
        _check_byte_level(steps[0])
        if not steps[0].get("use_regex", True):
            raise _Unsupported("ByteLevel pre-tokenizer without a split regex (whole texts as one piece)")
        return GPT2_PATTERN
    if kinds == ["Split", "ByteLevel"]:
        split, level = steps
        _check_byte_level(level)
        if level.get("use_regex", True):
            raise _Unsupported("Split then ByteLevel with its own regex (two splits)")
        if split.get("behavior") != "Isolated" or split.get("invert"):
            raise _Unsupported(f"Split pre-tokenizer with behavior {split.get('behavior')} "
                               f"invert={split.get('invert')} (only Isolated, not inverted)")
        pattern = split.get("pattern") or {}
        if "Regex" not in pattern:
            raise _Unsupported(f"Split pre-tokenizer by {sorted(pattern)} (only a Regex)")
        return str(pattern["Regex"])
    raise _Unsupported(f"pre-tokenizer {'+'.join(str(k) for k in kinds)} (not ByteLevel, or Split+ByteLevel)")


def _check_model(model: dict[str, Any]) -> None:
    if model.get("type") != "BPE":
        raise _Unsupported(f"model {model.get('type')} (not BPE)")
    if model.get("dropout"):
        raise _Unsupported(f"BPE dropout {model['dropout']} (not deterministic)")
    for knob in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(knob):
            raise _Unsupported(f"BPE {knob} {model[knob]!r}")
    if model.get("byte_fallback"):
        raise _Unsupported("BPE byte_fallback")


def _merges(model: dict[str, Any]) -> list[tuple[str, str]]:
    """``"a b"`` strings (older tokenizer.json) or ``["a", "b"]`` pairs."""
    out: list[tuple[str, str]] = []
    for i, merge in enumerate(model.get("merges") or []):
        parts = merge.split(" ") if isinstance(merge, str) else list(merge)
        if len(parts) != 2:
            raise _Unsupported(f"merge {i} {merge!r} is not a pair")
        out.append((parts[0], parts[1]))
    return out


def _special_tokens(added: list[dict[str, Any]], *, split_special: bool, nfc: bool) -> dict[str, int]:
    """The added tokens that the HF tokenizer cuts out of the text before BPE, as tiktoken special tokens."""
    matched = [t for t in added if not (split_special and t.get("special"))]
    for t in matched:
        flags = [k for k in ("lstrip", "rstrip", "single_word") if t.get(k)]
        if flags:
            raise _Unsupported(f"added token {t['content']!r} with {'+'.join(flags)}")
        if not t["content"]:
            raise _Unsupported("an empty added token")
        if nfc and t.get("normalized") and unicodedata.normalize("NFC", t["content"]) != t["content"]:
            raise _Unsupported(f"added token {t['content']!r} changes under its NFC normalizer")
    contents = sorted(t["content"] for t in matched)
    for a, b in itertools.pairwise(contents):  # a prefix of another sorts just before it
        if b.startswith(a):
            raise _Unsupported(f"added token {a!r} is a prefix of {b!r} (HF takes the longest, tiktoken the first)")
    # HF matches the non-normalized added tokens first, then the normalized ones in what is left: one pass
    # gives the same answer only when no token of one group overlaps or contains one of the other.
    raw = [t["content"] for t in matched if not t.get("normalized")]
    norm = [t["content"] for t in matched if t.get("normalized")]
    for a in raw:
        for b in norm:
            if _overlap(a, b):
                raise _Unsupported(f"added tokens {a!r} (not normalized) and {b!r} (normalized) overlap")
    return {t["content"]: int(t["id"]) for t in matched}


def _overlap(a: str, b: str) -> bool:
    if a in b or b in a:
        return True
    return any(a.endswith(b[:k]) or b.endswith(a[:k]) for k in range(1, min(len(a), len(b))))


def _mergeable_ranks(model: dict[str, Any], added_contents: set[str]) -> tuple[dict[bytes, int], list[str]]:
    """tiktoken's ranks (token bytes -> HF id) and the merged tokens (in byte-level characters), after checking
    that merge order is id order and that every regular token is a byte or a merge result."""
    vocab: dict[str, int] = model.get("vocab") or {}
    alphabet = byte_alphabet()
    ranks: dict[bytes, int] = {}
    missing = [f"0x{b:02x}" for c, b in alphabet.items() if c not in vocab]
    if missing:
        raise _Unsupported(f"{len(missing)} of 256 bytes have no token (e.g. {missing[0]}): not a byte-level BPE")
    for char, byte in alphabet.items():
        ranks[bytes([byte])] = vocab[char]

    merged: list[str] = []
    last_id, last_token = -1, ""
    for i, (a, b) in enumerate(_merges(model)):
        token = a + b
        for part in (a, b, token):
            if part not in vocab:
                raise _Unsupported(f"merge {i} ({a!r} {b!r}) names {part!r}, which is not in the vocab")
        token_id = vocab[token]
        if token_id < last_id or (token_id == last_id and token != last_token):
            raise _Unsupported(f"merge {i} ({a!r} {b!r}) makes id {token_id} after id {last_id}: merge order "
                               "is not id order, which tiktoken's ranks cannot express")
        if token_id != last_id:
            merged.append(token)
        last_id, last_token = token_id, token

    for token in merged:
        try:
            ranks[bytes(alphabet[c] for c in token)] = vocab[token]
        except KeyError:
            raise _Unsupported(f"merged token {token!r} has characters outside the byte-level alphabet") from None
    covered = set(alphabet) | set(merged) | added_contents
    stray = [t for t in vocab if t not in covered]
    if stray:
        raise _Unsupported(f"{len(stray)} vocab tokens are neither bytes, merge results nor added tokens "
                           f"(e.g. {stray[0]!r})")
    if len(set(ranks.values())) != len(ranks):
        raise _Unsupported("two byte strings share one id")
    return ranks, merged


def _check_whole_words(backend: Any, model: dict[str, Any], merged: Sequence[str]) -> None:
    """tiktoken emits a piece that is itself a token as that token; HF (without ignore_merges) runs the merges on
    it, which may end elsewhere for tokens the merges never reach as a whole word."""
    if model.get("ignore_merges"):
        return
    bpe = backend.model
    vocab = model["vocab"]
    for token in merged:
        got = [t.id for t in bpe.tokenize(token)]
        if got != [vocab[token]]:
            raise _Unsupported(f"merged token {token!r} (id {vocab[token]}) encodes to {got} as a whole word in "
                               "HF, but tiktoken would emit it whole")


# -- building and verifying -------------------------------------------------------------------------------------


def _build(hf: Any) -> tiktoken.Encoding:
    import tiktoken

    backend = _backend(hf)
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    _check_model(model)
    nfc = _is_nfc(spec.get("normalizer"))
    pattern = _split_pattern(spec.get("pre_tokenizer"))
    added = list(spec.get("added_tokens") or [])
    split_special = bool(getattr(hf, "split_special_tokens", False))
    special = _special_tokens(added, split_special=split_special, nfc=nfc)
    ranks, merged = _mergeable_ranks(model, {t["content"] for t in added})
    _check_whole_words(backend, model, merged)
    name = str(getattr(hf, "name_or_path", "") or "hf")
    try:
        return tiktoken.Encoding(f"swectl:{name}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
    except ValueError as exc:  # the split regex does not compile in tiktoken's regex dialect
        raise _Unsupported(f"tiktoken refuses the split regex {pattern!r}: {exc}") from None


def sample_corpus(extra: Iterable[str] = ()) -> list[str]:
    """Texts that exercise the split regex, the merges and the added tokens: code, a pytest log, a diff, prose
    with contractions, numbers in several scripts, many scripts and emoji, whitespace runs, control characters,
    ANSI escapes, special-token-looking text, long runs; plus ``extra`` and each of them twice in a row."""
    code = ('def f(x, *args, **kw) -> "X":\n\t"""Doc."""\n    if x is None:  # comment\r\n        return [1, 2.5e-3]\n'
            "\n\n    return {'k': x!r}\n")
    log = ("============================= test session starts ==============================\n"
           "tests/test_a.py::test_one PASSED                                         [ 50%]\n"
           "tests/test_a.py::test_two FAILED                                         [100%]\n"
           "E       AssertionError: assert 1 == 2\nE        +  where 1 = f()\n"
           "\x1b[31m\x1b[1m1 failed\x1b[0m, 1 passed in 0.03s\n")
    diff = ("diff --git a/src/m.py b/src/m.py\nindex 3b18e51..a2c4d0f 100644\n--- a/src/m.py\n+++ b/src/m.py\n"
            "@@ -1,4 +1,4 @@\n def g():\n-    return 1\n+    return  2\n \n")
    prose = ("It's what we'll do; they're here, I'd say. YOU'LL SEE, it'S fine. Don't. o'clock 'quoted'\n"
             "Numbers: 0 7 42 1234567890 3.14159 -1e9 0x1F 1_000 ٣٤٥ १२३ ½ ² Ⅻ ⑤\n")
    scripts = ("naïve café — “quotes” ‘x’ … ß ẞ Ǆ ǅ ﬁ Ω Ω Å Å\n中文字符测试，标点。日本語のテキスト、カタカナ ﾊﾝｶｸ\n"
               "한국어 텍스트 مرحبا بالعالم שלום עולם नमस्ते दुनिया สวัสดีชาวโลก Ελληνικά Русский текст\n"
               "😀 👍🏽 👨‍👩‍👧 🇩🇪 ✔️ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0001fa77 \ue000 \ufffd \ufeff")
    spaces = ("\u00a0\u2009\u200b\u200d\u2028\u2029\u3000\x85 x\x0b\x0cy\r\r\n\n"
              + " " * 37 + "\n" * 9 + "\t\t \n  \n x   \n \n \n   a" + " " * 200 + "b\t" * 30)
    controls = "".join(chr(c) for c in range(32)) + "\x7f" + "".join(chr(c) for c in range(0x80, 0xa0))
    decomposed = "cafe\u0301 A\u030a e\u0308\u0301 \u1100\u1161\u11a8 >\u0338"  # not NFC
    special = ("<|im_end|> <|im_start|>user\nhi<|im_end|>\n<|endoftext|><|endoftext|> <|im_end <|im_end| |> "
               "<|IM_END|> < |im_end|> <|im_end|>\u0338 <|unknown|> <tool_call> </think> [INST] <s> </s>")
    runs = "a" * 500 + " " + "=" * 300 + " " + "9" * 200 + " " + "ab" * 150 + " " + "\u00e9" * 100
    texts = [code, log, diff, prose, scripts, spaces, controls, decomposed, special, runs, "", " ", "\n", "a",
             " a", "a ", "'s", " 's", "x's'S", "1 2", " 12 345"]
    texts += list(extra)
    return [*texts, *(t + t for t in texts), "".join(texts)]


def _verify(hf: Any, fast: FastTokenizer, specials: Iterable[str]) -> None:
    extra = [f"x{s}y {s}{s} {s}\n" for s in specials]
    for text in sample_corpus(extra):
        want = hf.encode(text, add_special_tokens=False)
        got = fast.encode(text, add_special_tokens=False)
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            raise _Unsupported(f"ids differ from HF on {text[:60]!r}... at token {at}: tiktoken "
                               f"{got[at:at + 5]}, HF {want[at:at + 5]}")


def build_encoding(hf_tokenizer: Any) -> tuple[tiktoken.Encoding | None, str]:
    """The verified tiktoken Encoding for a HF tokenizer and ``""``, or ``None`` and the reason it cannot be
    built or did not verify (module docstring). Never raises for an unsupported tokenizer."""
    try:
        encoding = _build(hf_tokenizer)
        _verify(hf_tokenizer, FastTokenizer(hf_tokenizer, encoding), encoding.special_tokens_set)
    except _Unsupported as exc:
        return None, str(exc)
    except ImportError as exc:
        return None, f"tiktoken is not installed ({exc}); pip install 'swectl[cpu]'"
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a tokenizer.json shaped unlike any seen
        return None, f"cannot read the tokenizer's config: {type(exc).__name__}: {exc}"
    return encoding, ""


def tiktoken_encoding(hf_tokenizer: Any) -> tiktoken.Encoding | None:
    """The tiktoken Encoding that reproduces ``hf_tokenizer``'s ids, or None (the reason is logged)."""
    started = time.perf_counter()
    encoding, reason = build_encoding(hf_tokenizer)
    name = getattr(hf_tokenizer, "name_or_path", "") or type(hf_tokenizer).__name__
    if encoding is None:
        unexpected = reason.startswith(("ids differ", "cannot read"))
        level = logging.WARNING if unexpected else logging.INFO
        _log.log(level, "fast tokens: keeping the HF tokenizer of %s: %s", name, reason)
        return None
    _log.info("fast tokens: tiktoken encoding for %s (%d ids, %d added tokens), verified in %.2f s", name,
              encoding.n_vocab, len(encoding.special_tokens_set), time.perf_counter() - started)
    return encoding


# -- the wrapper -------------------------------------------------------------------------------------------------


class FastTokenizer:
    """A HF tokenizer whose ``encode`` and ``count`` go through a tiktoken Encoding of the same BPE (satisfies
    swectl.agent.trajectory.ChatTokenizer), and so does ``apply_chat_template``'s tokenizing (HF renders the
    text; the pieces between special tokens come from a cache, so a history re-rendered each turn encodes only its
    new messages). ``decode`` and every other attribute are the HF tokenizer's. Calls the encoding cannot serve
    exactly (other keyword arguments, non-str input, text with lone surrogates, text its NFC normalizer would
    change, a post-processor that adds tokens) go to HF.

    Build the encoding with ``tiktoken_encoding`` (which verifies it); ``fast_tokenizer`` does both."""

    def __init__(self, hf: Any, encoding: tiktoken.Encoding) -> None:
        self.hf = hf
        self.encoding = encoding
        self._special = frozenset(encoding.special_tokens_set)
        self._split_special = bool(getattr(hf, "split_special_tokens", False))
        self._normalizer = _backend(hf).normalizer  # None or NFC (tiktoken_encoding refuses others)
        # add_special_tokens=True is served too when the post-processor adds nothing (no BOS/EOS template)
        self._post_adds = hf.encode(_PROBE, add_special_tokens=True) != hf.encode(_PROBE, add_special_tokens=False)
        self._derive()

    def _derive(self) -> None:
        """The state made from the rest, never pickled: the special-token split and an empty segment cache."""
        object.__setattr__(self, "_specials_re", _specials_pattern(self._special))
        object.__setattr__(self, "_segments", SegmentCache(self.encoding.encode_ordinary))

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_specials_re", "_segments")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._derive()

    def _servable(self, text: Any, add_special_tokens: bool) -> bool:
        if type(text) is not str or (add_special_tokens and self._post_adds):
            return False
        if getattr(self.hf, "split_special_tokens", False) != self._split_special:
            return False
        if text.isascii():  # O(1) in CPython: no surrogates, nothing for NFC to change
            return True
        if _SURROGATE.search(text):  # HF refuses these (TypeError); let it say so
            return False
        # HF's own normalizer, not unicodedata: the same Unicode version as the ids it makes (and faster)
        return self._normalizer is None or self._normalizer.normalize_str(text) == text

    def encode(self, text: str, add_special_tokens: bool = True, **kw: Any) -> list[int]:
        """The HF tokenizer's ``encode``; through tiktoken when the call has no other keyword arguments."""
        if kw or not self._servable(text, add_special_tokens):
            return self.hf.encode(text, add_special_tokens=add_special_tokens, **kw)
        return self.encoding.encode(text, allowed_special=self._special, disallowed_special=())

    def count(self, text: str) -> int:
        """Tokens in ``text`` as ``encode(text, add_special_tokens=False)`` makes them."""
        return len(self.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], **kw: Any) -> str:
        return self.hf.decode(ids, **kw)

    def apply_chat_template(self, conversation: list[dict[str, str]], **kw: Any) -> Any:
        """The HF tokenizer's; a tokenized call renders the text with HF's template and encodes it here, as HF's
        own would (``encode(text, add_special_tokens=False)``: the template writes the special tokens itself), when
        it asks for nothing the tokenizer call would change (padding, truncation, tensors, masks) and is one
        conversation. The ids are then ``{"input_ids": ...}`` (``return_dict``, HF's default) or the list. Rendering
        is ~0.04 ms of the 1.4 ms HF takes for a 1,800-token history; the rest was its tokenizer call."""
        tokenize, return_dict = kw.get("tokenize", True), kw.get("return_dict", True)
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        if not tokenize or batched or any(kw.get(k) for k in _TOKENIZER_CALL_KWARGS):
            return self.hf.apply_chat_template(conversation, **kw)
        rest = {k: v for k, v in kw.items() if k not in ("tokenize", "return_dict", *_TOKENIZER_CALL_KWARGS)}
        ids = self._encode_rendered(self.hf.apply_chat_template(conversation, tokenize=False, **rest))
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def _encode_rendered(self, text: str) -> list[int]:
        """``encode(text, add_special_tokens=False)`` of a rendered conversation, its pieces between special tokens
        from the segment cache: a turn's rendering repeats every earlier message's, so only the new ones are
        encoded. tiktoken encodes the text between special-token matches independently, and no added token is a
        prefix of another (checked when the encoding is built), so the leftmost match is the same whichever
        alternative the split tries first: the ids are the whole text's."""
        if self._split_special or self._specials_re is None or not self._servable(text, False):
            return self.encode(text, add_special_tokens=False)  # as encode would: through HF where it must
        pieces = self._specials_re.split(text)  # ordinary, special, ordinary, ..., ordinary
        ids: list[int] = []
        for n, piece in enumerate(pieces):
            if n % 2:
                ids.append(self.encoding.encode_single_token(piece))
            elif piece:
                ids += self._segments.ids(piece)
        return ids

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.hf(*args, **kw)

    def __len__(self) -> int:
        return len(self.hf)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "hf" not in self.__dict__:  # copy/pickle probe before __init__ ran
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Settings written through the wrapper (chat_template, padding_side, ...) belong to the HF tokenizer.
        if name in _OWN_ATTRS:
            object.__setattr__(self, name, value)
        else:
            setattr(self.hf, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _OWN_ATTRS:
            object.__delattr__(self, name)
        else:
            delattr(self.hf, name)

    def __repr__(self) -> str:
        return f"FastTokenizer({self.encoding.name!r}, {type(self.hf).__name__})"


# apply_chat_template's arguments that change its tokenizer call, not its rendering: any one set goes to HF whole
_TOKENIZER_CALL_KWARGS = ("padding", "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask",
                          "tokenizer_kwargs", "sanitize_control_tokens")
_OWN_ATTRS = frozenset({"hf", "encoding", "_special", "_split_special", "_normalizer", "_post_adds", "_specials_re",
                        "_segments"})
SEGMENT_CACHE_TOKENS = 1_000_000  # the segment cache's ids at most (~36 MB of ints): a rollout's histories


def _specials_pattern(specials: Iterable[str]) -> re.Pattern[str] | None:
    """A split on the added tokens (captured), longest first; None when there are none."""
    ordered = sorted(specials, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(t) for t in ordered) + ")") if ordered else None


class SegmentCache:
    """Text between special tokens -> its ordinary ids, the oldest dropped past SEGMENT_CACHE_TOKENS ids; safe
    across threads (the tokenizer is shared). The lists it hands out are shared: read them, never change them."""

    def __init__(self, encode: Any, max_tokens: int = SEGMENT_CACHE_TOKENS) -> None:
        self._encode, self._max = encode, max_tokens
        self._ids: dict[str, list[int]] = {}
        self._held = 0
        self._lock = threading.Lock()

    def ids(self, text: str) -> list[int]:
        with self._lock:
            found = self._ids.get(text)
        if found is not None:
            return found
        ids = self._encode(text)
        with self._lock:
            if text not in self._ids and len(ids) <= self._max:
                self._ids[text] = ids
                self._held += len(ids)
                while self._held > self._max:
                    self._held -= len(self._ids.pop(next(iter(self._ids))))
        return ids

    def __len__(self) -> int:
        return len(self._ids)


def fast_tokenizer(hf_tokenizer: Any) -> Any:
    """``FastTokenizer`` around ``hf_tokenizer`` when a verified tiktoken encoding can be built, else
    ``hf_tokenizer`` itself (the reason is logged)."""
    encoding = tiktoken_encoding(hf_tokenizer)
    return hf_tokenizer if encoding is None else FastTokenizer(hf_tokenizer, encoding)
