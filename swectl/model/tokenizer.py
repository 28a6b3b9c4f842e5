"""Loading a model folder's tokenizer, for every command that needs one (eval, training, data, the judge).

Each error is a ConfigError naming the knob or flag that gave the folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swectl.errors import ConfigError


def check_tokenizer_folder(path: str, knob: str) -> None:
    """``path`` (given by ``knob``) must be a folder with a tokenizer; a ``--model`` folder also a config.json."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{knob} {path}: no such folder")
    if knob == "--model" and not (folder / "config.json").is_file():
        raise ConfigError(f"--model {path}: not a model folder (no config.json); give a Hugging Face model folder, "
                          "e.g. one made by `swectl model init`")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ConfigError(f"{knob} {path}: no tokenizer there (no tokenizer.json or tokenizer_config.json)")


def load_tokenizer(path: str, knob: str) -> Any:  # a transformers tokenizer
    """The tokenizer in folder ``path`` (given by ``knob``), or a ConfigError naming the knob. A byte-level BPE
    comes wrapped in swectl.model.fast_tokens.FastTokenizer (tiktoken encodes, same ids)."""
    check_tokenizer_folder(path, knob)
    from transformers import AutoTokenizer

    from swectl.model.fast_tokens import fast_tokenizer

    try:
        return fast_tokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{knob} {path}: cannot load its tokenizer: {first}") from exc
