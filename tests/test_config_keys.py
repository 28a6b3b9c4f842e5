"""The config is frozen like the CLI: every key of cluster.toml (as ``--set`` names it) with its type and default
must equal ``tests/config_keys.txt``, so a new, moved or retyped key is a decision seen in review. After a
deliberate change:

    SWECTL_UPDATE_CONFIG_KEYS=1 .venv/bin/python -m pytest tests/test_config_keys.py
"""

from __future__ import annotations

import difflib
import os
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from swectl.config import MOVED_KEYS, ConfigError, config_leaves, load_config

SNAPSHOT = Path(__file__).with_name("config_keys.txt")
UPDATE = "SWECTL_UPDATE_CONFIG_KEYS"


def _type_name(kind: Any) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "").replace("swectl.config.", "")


def test_the_config_keys_match_the_snapshot() -> None:
    now = "".join(f"{leaf.key}: {_type_name(leaf.field.type)} = "
                  f"{msgspec.json.encode(msgspec.to_builtins(leaf.value)).decode()}\n" for leaf in config_leaves())
    if os.environ.get(UPDATE):
        SNAPSHOT.write_text(now)
    before = SNAPSHOT.read_text()
    if now != before:
        diff = "".join(difflib.unified_diff(before.splitlines(True), now.splitlines(True), "tests/config_keys.txt",
                                            "swectl now", n=1))
        pytest.fail(f"the config keys changed; if that is intended, run with {UPDATE}=1 and commit the snapshot\n"
                    + diff)


def test_the_train_sections_have_at_most_fourteen_keys_each() -> None:
    """Config by consumer: each section goes whole to one component; a section that grows past this is two."""
    keys = Counter(leaf.section for leaf in config_leaves())
    for section in ("train", "train.data", "train.sampling", "train.optim", "train.loss", "reward", "experiment"):
        assert 0 < keys[section] <= 14, f"[{section}] has {keys[section]} keys"


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_a_key_that_moved_names_its_new_place(old: str) -> None:
    with pytest.raises(ConfigError, match=f"{old} is now {MOVED_KEYS[old]}"):
        load_config(None, [f"{old}=1"])
    new = MOVED_KEYS[old]
    assert new in {leaf.key for leaf in config_leaves()}, f"{new} does not exist"
