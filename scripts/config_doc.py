"""docs/config.md from the config Structs: every key of cluster.toml with its type, default and the comment that
explains it in swectl/config.py (the comment on the field's line, or the comment lines just above it).

    python scripts/config_doc.py            print it
    python scripts/config_doc.py --write    write docs/config.md

tests/test_docs.py checks docs/config.md equals this output, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec

ROOT = Path(__file__).resolve().parents[1]
CONFIG_SOURCE = ROOT / "swectl" / "config.py"
OUT = ROOT / "docs" / "config.md"

HEADER = """# Configuration reference

Generated from `swectl/config.py` by `scripts/config_doc.py` (`--write` regenerates it; a test checks it matches).
A cluster file is TOML; every key can also be given on the command line as `--set section.key=value` (values
parse as TOML). Unknown keys, wrong types and contradictions are refused with the key's path and a hint;
`swectl check-config FILE` prints the resolved config. `examples/local.toml` is the embedded default written out.
"""


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


def field_notes(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> its explanation: the comment on its line, else the comment lines just above."""
    comments = _comments(source)
    lines = source.splitlines()
    notes = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            text = comments.get(item.lineno, "")
            if not text:
                above, line = [], item.lineno - 1
                while line >= 1 and lines[line - 1].strip().startswith("#"):
                    above.insert(0, comments.get(line, ""))
                    line -= 1
                text = " ".join(above)
            notes[(node.name, item.target.id)] = text
    return notes


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _type_name(kind: Any) -> str:
    """A key's type as a user reads it: ``int >= 1``, ``"grpo" | "sft"``, ``list[str]``, ``float or unset``."""
    origin, args = get_origin(kind), get_args(kind)
    if origin is Annotated:
        meta = next((a for a in args[1:] if isinstance(a, msgspec.Meta)), None)
        bounds = [f"{sign} {getattr(meta, name)}" for name, sign in _BOUNDS if getattr(meta, name, None) is not None]
        if meta is not None and meta.pattern:
            bounds.append("(a name)")
        return " ".join([_type_name(args[0]), *bounds])
    if origin is Literal:
        return " \\| ".join(f'"{a}"' for a in args)
    if origin in (Union, UnionType):
        named = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or unset" if type(None) in args else "")
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")


def _row(key: str, owner: type, field: msgspec.structs.FieldInfo, default: str,
         notes: dict[tuple[str, str], str]) -> str:
    note = notes.get((owner.__name__, field.name), "").replace("|", "\\|")
    return f"| `{key}` | `{_type_name(field.type)}` | `{default}` | {note} |"


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from swectl.config import LocalNodeConfig, SshNodeConfig, config_leaves

    notes = field_notes(CONFIG_SOURCE.read_text())
    sections: dict[str, tuple[type, list[str]]] = {}  # title -> (the section's Struct, its rows)
    for leaf in config_leaves():
        _, rows = sections.setdefault(leaf.section or "(top level)", (leaf.owner, []))
        rows.append(_row(leaf.key, leaf.owner, leaf.field,
                         msgspec.json.encode(msgspec.to_builtins(leaf.value)).decode(), notes))
    for name, kind in (("nodes[] (kind = \"local\")", LocalNodeConfig), ("nodes[] (kind = \"ssh\")", SshNodeConfig)):
        sections[name] = (kind, [])
        for field in msgspec.structs.fields(kind):
            default = "(required)" if field.required else msgspec.json.encode(
                msgspec.to_builtins(field.default if field.default is not msgspec.NODEFAULT
                                    else field.default_factory())).decode()
            sections[name][1].append(_row(field.name, kind, field, default, notes))
    out = [HEADER]
    for name, (kind, rows) in sections.items():
        title = name if name.startswith(("(", "nodes")) else f"[{name}]"
        doc = (kind.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        out.append(f"## {title}\n\n{doc}\n\n| key | type | default | what it is |\n|---|---|---|---|")
        out.append("\n".join(rows) + "\n")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(ROOT)}")
    args = parser.parse_args()
    text = render()
    if args.write:
        OUT.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
