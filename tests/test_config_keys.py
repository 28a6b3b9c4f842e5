"""The config is frozen like the CLI: every key of cluster.toml (as ``--set`` names it) with its type and default
must equal ``tests/config_keys.txt``, so a new, moved or retyped key is a decision seen in review. After a
deliberate change:

    SWECTL_UPDATE_CONFIG_KEYS=1 .venv/bin/python -m pytest tests/test_config_keys.py
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from swectl.config import MOVED_KEYS, ClusterConfig, ConfigError, load_config

SNAPSHOT = Path(__file__).with_name("config_keys.txt")
UPDATE = "SWECTL_UPDATE_CONFIG_KEYS"


def _type_name(kind: Any) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "").replace("swectl.config.", "")


def _keys(kind: Any, instance: Any, prefix: str = "") -> list[str]:
    lines = []
    for field in msgspec.structs.fields(kind):
        value = getattr(instance, field.name)
        if isinstance(value, msgspec.Struct) and not isinstance(value, list):
            lines += _keys(type(value), value, f"{prefix}{field.name}.")
        else:
            shown = msgspec.json.encode(msgspec.to_builtins(value)).decode()
            lines.append(f"{prefix}{field.name}: {_type_name(field.type)} = {shown}")
    return lines


def test_the_config_keys_match_the_snapshot() -> None:
    now = "\n".join(_keys(ClusterConfig, ClusterConfig())) + "\n"
    if os.environ.get(UPDATE):
        SNAPSHOT.write_text(now)
    before = SNAPSHOT.read_text()
    if now != before:
        diff = "".join(difflib.unified_diff(before.splitlines(True), now.splitlines(True), "tests/config_keys.txt",
                                            "swectl now", n=1))
        pytest.fail(f"the config keys changed; if that is intended, run with {UPDATE}=1 and commit the snapshot\n"
                    + diff)


def test_the_train_sections_have_no_more_than_a_dozen_keys_each() -> None:
    """Config by consumer: each section goes whole to one component; a section that grows past this is two."""
    for section in ("train", "train.data", "train.sampling", "train.optim", "train.loss", "reward", "experiment"):
        target: Any = ClusterConfig()
        for part in section.split("."):
            target = getattr(target, part)
        flat = [f for f in msgspec.structs.fields(type(target))
                if not isinstance(getattr(target, f.name), msgspec.Struct)]
        assert len(flat) <= 14, f"[{section}] has {len(flat)} keys"


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_a_key_that_moved_names_its_new_place(old: str) -> None:
    with pytest.raises(ConfigError, match=f"{old} is now {MOVED_KEYS[old]}"):
        load_config(None, [f"{old}=1"])
    new = MOVED_KEYS[old]
    section, _, key = new.rpartition(".")
    target: Any = ClusterConfig()
    for part in section.split("."):
        target = getattr(target, part)
    assert key in msgspec.structs.asdict(target), f"{new} does not exist"
