"""Fixtures shared by the unit and the integration tests (pytest applies this file to `integration/` too).

Shared data lives beside the checkout, in `<repo>/../shared/data/`, and is found only through
`shared_data()`: a missing file fails the test that needs it (it is never a silent skip).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from swectl.tasks import specs as specs_mod
from swectl.tasks.specs import SpecTable, load_specs

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
FETCH = REPO_ROOT / "scripts" / "fetch_swebench_specs.sh"
VERIFIED_NAME = "swe_bench_verified.jsonl"


def shared_data(name: str) -> Path:
    """`<repo>/../shared/data/<name>`; fails the calling test (never skips it) when the file is missing."""
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.fail(f"shared data file {path} is missing (expected beside the checkout, in ../shared/data/)",
                    pytrace=False)
    return path


@pytest.fixture(scope="session")
def verified_path() -> Path:
    """The 500 SWE-bench Verified rows (JSONL) from the shared data folder."""
    return shared_data(VERIFIED_NAME)


@pytest.fixture(scope="session")
def specs() -> SpecTable:
    """The real SWE-bench 4.1.0 table; runs the fetch script (needs PyPI) only when no specs file is in place.

    A failed fetch fails the tests that need the table (it does not skip them)."""
    if not any(p.is_file() for p in specs_mod.default_spec_paths()):
        done = subprocess.run(["bash", str(FETCH)], capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            pytest.fail(f"fetch_swebench_specs.sh failed (offline?): {done.stderr[-500:]}", pytrace=False)
    return load_specs()


TINY_TOKENIZER_CORPUS = [
    "def f(x):\n    return x\n",
    "```bash\nls -la\n```\n",
    "ls -la\nfile.py\n```bash\n",
    "THOUGHT: look around first.\n```bash\ncat file.py\n```\n",
    "The command printed nothing.\nhello world 0 1 2 3 4 5 6 7 8 9\n",
]


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """The tiny tokenizer of `swectl model init` (byte-level BPE, swectl's ChatML template, 600 ids), trained
    once per session on a few agent-like snippets and swectl/schema.py; a `transformers` PreTrainedTokenizerFast."""
    pytest.importorskip("transformers", reason="needs the cpu extra (pip install 'swectl[cpu]')")
    pytest.importorskip("tokenizers", reason="needs the cpu extra (pip install 'swectl[cpu]')")
    from swectl.model.tiny import ModelInitConfig, hf_tokenizer, train_tokenizer

    cfg = ModelInitConfig(vocab_size=600)
    source = (REPO_ROOT / "swectl" / "schema.py").read_text(encoding="utf-8").splitlines(keepends=True)
    return hf_tokenizer(train_tokenizer(cfg, TINY_TOKENIZER_CORPUS * 100 + source), cfg)
