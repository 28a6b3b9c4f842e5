"""The house's shape in numbers, for a refactor's before/after table (issue 38).

    python scripts/house_stats.py [--json] [--top 10]

Prints the lines of code per layer (the layers of tests/test_layout.py), the longest functions, the number of
config keys (every leaf of ClusterConfig, as ``--set`` names them), the CLI's flags (tests/cli_help.txt), the
largest files, the ``tg.start`` sites of the product, and the kind branches outside their seams (issue 57: an
engine kind or a sandbox backend decided anywhere but actors/engine_kinds.py and remote/nodes/backends.py, each
line listed). Lines are non-blank, non-comment source lines (docstrings count).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_layout import LAYERS, SOURCE_ROOTS  # noqa: E402  (the one definition of the layers)


def _module_name(path: Path) -> str:
    top, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [SOURCE_ROOTS[top], *rest]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer_of(module: str) -> str:
    best, best_len = "other", -1
    for layer, packages in LAYERS.items():
        for package in packages:
            if (module == package or module.startswith(package + ".")) and len(package) > best_len:
                best, best_len = layer, len(package)
    return best


def _code_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def _functions(path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            found.append((length, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return found


# an engine kind or sandbox backend compared, or an engine client's class tested
KIND_BRANCH = re.compile(r"\b(?:engine|config|cfg|_config)\.kind\s*(?:==|!=|in\b)|\bsandbox\.backend\s*(?:==|!=|in\b)"
                         r"|isinstance\([^)]*(?:VllmClient|SglangClient)")
KIND_SEAMS = ("actors/engine_kinds.py", "remote/nodes/backends.py")
TG_START = re.compile(r"await \w+\.start\(")


def collect(top: int) -> dict[str, Any]:
    from swectl.config import config_leaves

    layers: dict[str, int] = {}
    files: list[tuple[int, str]] = []
    functions: list[tuple[int, str]] = []
    branches: list[str] = []
    starts = 0
    for root in SOURCE_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            text = path.read_text()
            rel = str(path.relative_to(ROOT))
            starts += len(TG_START.findall(text))
            if rel not in KIND_SEAMS:
                branches += [f"{rel}:{n} {line.strip()[:100]}" for n, line in enumerate(text.splitlines(), 1)
                             if KIND_BRANCH.search(line)]
            lines = _code_lines(text)
            layer = _layer_of(_module_name(path))
            layers[layer] = layers.get(layer, 0) + lines
            files.append((lines, str(path.relative_to(ROOT))))
            functions.extend(_functions(path, ast.parse(text)))
    for extra in ("benchmarks", "experiments", "tests"):
        layers[extra] = sum(_code_lines(p.read_text()) for p in (ROOT / extra).rglob("*.py"))
        for path in (ROOT / extra).rglob("*.py"):
            files.append((_code_lines(path.read_text()), str(path.relative_to(ROOT))))
    keys = [leaf.key for leaf in config_leaves()]
    sections: dict[str, int] = {}
    for key in keys:
        section = key.split(".")[0]
        sections[section] = sections.get(section, 0) + 1
    help_text = (ROOT / "tests" / "cli_help.txt").read_text()
    flags = {m.group(0) for m in re.finditer(r"(?<![\w-])--[a-z][\w-]*", help_text)}
    return {
        "lines_per_layer": layers,
        "cli_flags": len(flags),
        "tg_start_sites": starts,
        "kind_branches_outside_seams": branches,
        "config_keys": len(keys),
        "config_keys_per_section": sections,
        "longest_functions": [f"{n} {where}" for n, where in sorted(functions, reverse=True)[:top]],
        "largest_files": [f"{n} {where}" for n, where in sorted(files, reverse=True)[:top]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument("--top", type=int, default=10, help="how many functions and files to list")
    args = parser.parse_args()
    stats = collect(args.top)
    if args.json:
        print(json.dumps(stats, indent=1))
        return
    print("lines of code per layer: " + ", ".join(f"{k} {v}" for k, v in stats["lines_per_layer"].items()))
    print(f"config keys: {stats['config_keys']} (" + ", ".join(f"{k} {v}" for k, v in
                                                        stats["config_keys_per_section"].items()) + ")")
    print(f"CLI flags (distinct): {stats['cli_flags']}; tg.start sites in the product: {stats['tg_start_sites']}")
    print(f"kind branches outside their seams: {len(stats['kind_branches_outside_seams'])}")
    print("\n".join("  " + line for line in stats["kind_branches_outside_seams"]))
    print("longest functions (lines):")
    print("\n".join("  " + line for line in stats["longest_functions"]))
    print("largest files (code lines):")
    print("\n".join("  " + line for line in stats["largest_files"]))


if __name__ == "__main__":
    main()
