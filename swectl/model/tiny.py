"""``swectl model init``: a tiny Qwen3-architecture model made locally, with no hub.

The embedded default (docs/architecture.md 11.2) needs a policy that exists on a machine with no network: this module
trains a byte-level BPE tokenizer on local source code (by default the running interpreter's standard library), builds a
randomly initialised ``Qwen3ForCausalLM`` from a small config, and saves both, with a ChatML chat template and a
generation config, as an ordinary Hugging Face model folder. Any other local HF model folder works in its place.

Everything is a function of the config: the same config, corpus and library versions give the same tokenizer and
bit-identical weights. ``swectl_model.json`` in the folder records the config, the parameter count, the corpus
and a hash of the tokenizer for provenance.

torch, transformers and tokenizers are imported inside functions so that ``swectl --help`` stays fast.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from swectl.errors import ConfigError, SwectlError

if TYPE_CHECKING:
    import tokenizers
    import torch
    from transformers import PreTrainedTokenizerBase

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2 in this order
BYTE_ALPHABET_SIZE = 256

DEFAULT_OUT = Path("runs/models/tiny-qwen3")
PROVENANCE_FILE = "swectl_model.json"
PROVENANCE_FORMAT = 1

# Path components skipped while collecting the corpus unless the glob names them itself: third-party packages
# installed under the stdlib folder (pyenv, Debian) would make the default corpus depend on the machine.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})

# ChatML as Qwen writes it: every message renders on its own, so rendering messages[:k] is a prefix of rendering
# messages[:k+1] (the agent appends template tokens instead of re-rendering). Content is a string, or a list of
# OpenAI-style parts of which the text parts are kept.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
GENERATION_PROMPT = f"{IM_START}assistant\n"


class ModelInitError(SwectlError):
    """The model folder cannot be written (it exists and holds something else), or the ML stack is missing."""


def _stdlib_globs() -> tuple[str, ...]:
    return (str(Path(sysconfig.get_paths()["stdlib"]) / "**" / "*.py"),)


class ModelInitConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Architecture, tokenizer and seed of a tiny Qwen3 model. The defaults make about 1.8 M parameters."""

    vocab_size: int = 8192  # model embedding rows; the tokenizer trains up to this many tokens
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 8192
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    seed: int = 0
    # Tokenizer corpus: files matching any glob (recursive `**`), read in sorted path order, UTF-8 only, until
    # corpus_max_bytes. Default: the Python source of the running interpreter's standard library.
    corpus_globs: tuple[str, ...] = msgspec.field(default_factory=_stdlib_globs)
    corpus_max_bytes: int = 5_000_000

    def __post_init__(self) -> None:
        positive = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings", "corpus_max_bytes")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"model init: {name} must be >= 1, got {getattr(self, name)}")
        smallest = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
        if self.vocab_size < smallest:
            raise ConfigError(f"model init: vocab_size must be >= {smallest} (256 bytes + special tokens), "
                              f"got {self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"model init: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"model init: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ConfigError(f"model init: rope_theta must be > 0, got {self.rope_theta}")
        if not self.corpus_globs:
            raise ConfigError("model init: corpus_globs is empty; name at least one glob of source files")


class CorpusInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the tokenizer was trained on: file and byte counts and a sha256."""
    files: int
    bytes: int
    sha256: str  # of the texts as trained on, each followed by a NUL


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What ``init_model`` made."""

    path: str
    parameters: int  # distinct parameters (tied embeddings counted once)
    vocab_size: int  # model embedding rows
    tokenizer_vocab_size: int  # tokens the tokenizer knows (<= vocab_size)
    tokenizer_sha256: str
    seconds: float


class ModelProvenance(msgspec.Struct, frozen=True, kw_only=True):
    """Contents of ``swectl_model.json``. No timestamps, so the same inputs write the same file."""

    format: int = PROVENANCE_FORMAT
    config: ModelInitConfig
    parameters: int
    tokenizer_vocab_size: int
    tokenizer_sha256: str
    special_tokens: dict[str, int]
    corpus: CorpusInfo
    versions: dict[str, str]


# -- corpus and tokenizer ----------------------------------------------------------------------------------------


def _skipped(path: str, pattern: str) -> bool:
    named = set(Path(pattern).parts)
    return any(part in _SKIPPED_DIRS and part not in named for part in Path(path).parts)


def corpus_files(globs: Sequence[str]) -> list[Path]:
    """Files matching any of the globs, deduplicated, in sorted path order."""
    found: set[str] = set()
    for pattern in globs:
        expanded = os.path.expanduser(pattern)
        found.update(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p) and not _skipped(p, expanded))
    return [Path(p) for p in sorted(found)]


def read_corpus(cfg: ModelInitConfig) -> tuple[list[str], CorpusInfo]:
    """The corpus texts, in sorted file order, capped at ``cfg.corpus_max_bytes`` (the last one cut at a character
    boundary). Files that are not UTF-8 are skipped. Raises ConfigError when nothing usable matches."""
    texts: list[str] = []
    digest = hashlib.sha256()
    budget = cfg.corpus_max_bytes
    for path in corpus_files(cfg.corpus_globs):
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        kept = data[:budget]
        text = kept.decode("utf-8", errors="ignore")  # "ignore" drops only a character cut at the end
        if text:
            texts.append(text)
            digest.update(text.encode("utf-8") + b"\0")
            budget -= len(text.encode("utf-8"))
        if len(kept) < len(data):
            break  # this file was cut: the corpus is full
    if not texts:
        raise ConfigError(f"model init: no readable UTF-8 files match corpus globs {list(cfg.corpus_globs)}")
    return texts, CorpusInfo(files=len(texts), bytes=cfg.corpus_max_bytes - budget, sha256=digest.hexdigest())


def _require_ml() -> None:
    missing = []
    for name in ("torch", "transformers", "tokenizers"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ModelInitError(f"swectl model init needs {', '.join(missing)}: pip install 'swectl[cpu]'")


def train_tokenizer(cfg: ModelInitConfig, texts: Sequence[str] | None = None) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer trained on the corpus (``texts``, or ``read_corpus(cfg)``), deterministic given
    it. Any string round-trips through encode/decode; the special tokens have ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if texts is None:
        texts, _ = read_corpus(cfg)
    tokenizer = Tokenizer(models.BPE())
    # No normalizer: text must come back byte for byte.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def tokenizer_sha256(tokenizer: tokenizers.Tokenizer) -> str:
    """sha256 of the tokenizer's vocab, merges and added (special) tokens, in a canonical JSON form."""
    spec = json.loads(tokenizer.to_str())
    core = {"vocab": spec["model"]["vocab"], "merges": spec["model"]["merges"], "added": spec["added_tokens"]}
    return hashlib.sha256(json.dumps(core, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def special_token_ids(tokenizer: tokenizers.Tokenizer) -> dict[str, int]:
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    if any(i is None for i in ids.values()):
        raise ModelInitError(f"tokenizer lacks special tokens: {ids}")
    return ids  # type: ignore[return-value]


def hf_tokenizer(tokenizer: tokenizers.Tokenizer, cfg: ModelInitConfig) -> PreTrainedTokenizerBase:
    """Wrap for transformers: eos ``<|im_end|>`` (ends an assistant turn), pad and bos ``<|endoftext|>`` (bos is
    never added to inputs, as in Qwen), the ChatML chat template, no clean-up of spaces on decode."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=ENDOFTEXT,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=cfg.max_position_embeddings,
    )


# -- model ---------------------------------------------------------------------------------------------------------


def _rope_parameters(cfg: ModelInitConfig) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": cfg.rope_theta}


def qwen3_config(cfg: ModelInitConfig, ids: dict[str, int]) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,  # transformers 4.x reads this, 5.x the next one; each ignores the other
        rope_parameters=_rope_parameters(cfg),
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT],
    )


def build_model(cfg: ModelInitConfig, ids: dict[str, int]) -> torch.nn.Module:
    """A randomly initialised Qwen3ForCausalLM in float32. Seeded from ``cfg.seed`` in a forked RNG, so the global
    torch RNG of the caller is left as it was."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen3ForCausalLM(qwen3_config(cfg, ids))
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT], eos_token_id=[ids[IM_END], ids[ENDOFTEXT]], pad_token_id=ids[ENDOFTEXT]
    )
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


# -- the folder ---------------------------------------------------------------------------------------------------


def _check_target(out_dir: Path, overwrite: bool) -> None:
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ModelInitError(f"{out_dir} exists and is not a folder")
    if not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise ModelInitError(f"{out_dir} is not empty; pass --overwrite (overwrite=True) to replace a model there")
    if not (out_dir / PROVENANCE_FILE).is_file():
        raise ModelInitError(f"{out_dir} is not empty and holds no {PROVENANCE_FILE}: refusing to replace a folder "
                             "that swectl model init did not make")


def _patch_json(path: Path, *, missing: dict[str, Any], replace: dict[str, Any] | None = None) -> None:
    """Add the ``missing`` keys that a JSON file lacks and set the ``replace`` ones."""
    data = json.loads(path.read_text())
    data.update({k: v for k, v in missing.items() if k not in data})
    data.update(replace or {})
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _save(stage: Path, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, cfg: ModelInitConfig) -> None:
    model.save_pretrained(stage)  # safetensors
    tokenizer.save_pretrained(stage)
    # transformers 5 writes keys that 4.x readers (SGLang, older engines) do not know: keep the old spellings
    # beside them so every reader sees the same rope base, dtype, tokenizer class and chat template.
    _patch_json(stage / "config.json", missing={"torch_dtype": "float32"},
                replace={"rope_theta": cfg.rope_theta, "rope_parameters": _rope_parameters(cfg)})
    _patch_json(stage / "tokenizer_config.json", missing={"chat_template": CHAT_TEMPLATE},
                replace={"tokenizer_class": "PreTrainedTokenizerFast"})
    if not (stage / "model.safetensors").is_file():
        raise ModelInitError(f"transformers did not write model.safetensors in {stage}")
    stage.chmod(0o755)  # mkdtemp made it private; a model folder is read by engines running as other users
    for path in stage.iterdir():
        path.chmod(0o644)


def _install(stage: Path, out_dir: Path) -> None:
    """Move the finished stage folder to out_dir; a previous model there (checked by _check_target) goes away
    only after the new one is in place."""
    old: Path | None = None
    if out_dir.exists():
        if any(out_dir.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "model")
        else:
            out_dir.rmdir()
    os.replace(stage, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {"python": sys.version.split()[0], "torch": str(torch.__version__), "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__}


def init_model(
    out_dir: Path,
    cfg: ModelInitConfig | None = None,
    *,
    overwrite: bool = False,
    progress: Callable[[str], object] = print,
) -> ModelInfo:
    """Train the tokenizer, build the model and save both as a Hugging Face model folder at ``out_dir``.

    The folder is written under a temporary name beside ``out_dir`` and moved into place when complete. A non-empty
    ``out_dir`` is refused unless ``overwrite`` is set, and even then only when it is a folder this function made.
    """
    cfg = cfg or ModelInitConfig()
    out_dir = Path(out_dir)
    _check_target(out_dir, overwrite)
    _require_ml()
    start = time.perf_counter()

    texts, corpus = read_corpus(cfg)
    progress(f"tokenizer corpus: {corpus.files} files, {corpus.bytes / 1e6:.2f} MB")
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(cfg, texts)
    del texts
    ids = special_token_ids(tokenizer)
    progress(f"trained byte-level BPE: {tokenizer.get_vocab_size()} tokens in {time.perf_counter() - t0:.1f} s")

    model = build_model(cfg, ids)
    parameters = count_parameters(model)
    progress(f"built Qwen3ForCausalLM: {parameters:,} parameters ({cfg.num_hidden_layers} layers, "
             f"hidden {cfg.hidden_size}, seed {cfg.seed})")

    digest = tokenizer_sha256(tokenizer)
    provenance = ModelProvenance(config=cfg, parameters=parameters, tokenizer_vocab_size=tokenizer.get_vocab_size(),
                                 tokenizer_sha256=digest, special_tokens=ids, corpus=corpus, versions=_versions())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.new-", dir=out_dir.parent))
    try:
        _save(stage, model, hf_tokenizer(tokenizer, cfg), cfg)
        (stage / PROVENANCE_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(provenance)) + b"\n")
        _check_target(out_dir, overwrite)  # again: something may have appeared there meanwhile
        _install(stage, out_dir)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    progress(f"saved {out_dir} in {seconds:.1f} s")
    return ModelInfo(path=str(out_dir), parameters=parameters, vocab_size=cfg.vocab_size,
                     tokenizer_vocab_size=tokenizer.get_vocab_size(), tokenizer_sha256=digest, seconds=seconds)


def load_provenance(model_dir: Path) -> ModelProvenance:
    """The ``swectl_model.json`` of a folder made by ``init_model``."""
    return msgspec.json.decode((Path(model_dir) / PROVENANCE_FILE).read_bytes(), type=ModelProvenance)
