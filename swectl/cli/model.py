"""`swectl model init`: the tiny Qwen3 policy of the embedded default (swectl/model/tiny.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import msgspec

from swectl import logs
from swectl.cli.common import say
from swectl.errors import ConfigError
from swectl.model.tiny import DEFAULT_OUT, ModelInitConfig, init_model

_INIT_DESCRIPTION = """\
Create a tiny Qwen3-architecture model locally (nothing is downloaded): train a byte-level BPE tokenizer on
local source code, initialise the weights from --seed, and save a Hugging Face model folder (safetensors,
tokenizer with a ChatML chat template, generation config, and swectl_model.json for provenance).

It is the embedded default's policy; any local Hugging Face model folder works in its place.
The same options on the same machine give the same tokenizer and bit-identical weights."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    defaults = ModelInitConfig()
    model = sub.add_parser("model", help="create local models (the embedded default's policy)")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = msub.add_parser("init", help="create a tiny Qwen3 model with a tokenizer trained on local code",
                           description=_INIT_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    init.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="DIR",
                      help=f"model folder to create (default {DEFAULT_OUT})")
    init.add_argument("--layers", type=int, default=None, metavar="N",
                      help=f"transformer layers (default {defaults.num_hidden_layers})")
    init.add_argument("--hidden", type=int, default=None, metavar="N",
                      help=f"hidden size (default {defaults.hidden_size})")
    init.add_argument("--intermediate", type=int, default=None, metavar="N",
                      help="MLP size (default 3 x hidden)")
    init.add_argument("--vocab", type=int, default=None, metavar="N",
                      help=f"vocabulary size: tokenizer target and embedding rows (default {defaults.vocab_size})")
    init.add_argument("--context", type=int, default=None, metavar="N",
                      help=f"positions the model takes, prompt and reply (max_position_embeddings; default "
                      f"{defaults.max_position_embeddings}): a CLI agent's first prompt with its tools is 6-26k tokens")
    init.add_argument("--seed", type=int, default=None, metavar="N",
                      help=f"weight initialisation seed (default {defaults.seed})")
    init.add_argument("--corpus", nargs="+", default=None, metavar="GLOB",
                      help="tokenizer training files, recursive globs such as 'src/**/*.py', read in sorted order "
                      "(default: this Python's standard library source)")
    init.add_argument("--corpus-max-bytes", type=int, default=None, metavar="N",
                      help=f"read at most this much corpus (default {defaults.corpus_max_bytes:,})")
    init.add_argument("--untied", action="store_true",
                      help="give the output head its own weights instead of tying it to the embeddings (for "
                      "training under vLLM engines: vLLM's weight reload leaves a tied head stale)")
    init.add_argument("--overwrite", action="store_true",
                      help="replace an existing model folder made by swectl model init")
    init.add_argument("--json", action="store_true", help="print what was made as JSON")


def config_from_args(args: argparse.Namespace) -> ModelInitConfig:
    """A ModelInitConfig with the defaults, changed only where an option was given."""
    changes: dict[str, Any] = {}
    for option, field in (("layers", "num_hidden_layers"), ("hidden", "hidden_size"), ("vocab", "vocab_size"),
                          ("context", "max_position_embeddings"),
                          ("seed", "seed"), ("corpus_max_bytes", "corpus_max_bytes")):
        if getattr(args, option) is not None:
            changes[field] = getattr(args, option)
    if args.intermediate is not None:
        changes["intermediate_size"] = args.intermediate
    elif args.hidden is not None:
        changes["intermediate_size"] = 3 * args.hidden
    if args.untied:
        changes["tie_word_embeddings"] = False
    if args.corpus:
        changes["corpus_globs"] = tuple(os.path.abspath(os.path.expanduser(g)) for g in args.corpus)
    return ModelInitConfig(**changes)


def run(args: argparse.Namespace) -> int:
    if args.model_command != "init":
        raise ConfigError(f"unknown model action {args.model_command!r}; the actions: init")
    info = init_model(args.out, config_from_args(args), overwrite=args.overwrite, progress=say)
    if args.json:
        logs.out().write(msgspec.json.encode(info).decode() + "\n")
    else:
        print(f"{info.path}: {info.parameters:,} parameters, vocab {info.tokenizer_vocab_size}/{info.vocab_size}",
              file=logs.out())
    return 0
