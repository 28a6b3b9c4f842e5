"""Docstrings stay true: every public class in swectl/, actors/ and remote/ has one, and every exception class
of the product derives from SwectlError and is named in the tree that swectl/errors.py documents."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("swectl", "actors", "remote")
# Runs inside sandboxes on the standard library alone (no swectl import), so it defines its own errors.
STDLIB_ONLY = {Path("remote/programs/exec_agent.py"), Path("remote/programs/nsbox.py")}  # shipped to nodes


def product_files() -> Iterator[Path]:
    for top in PRODUCT:
        for path in sorted((REPO / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path


def classes(tree: ast.Module) -> Iterator[ast.ClassDef]:
    """Classes at module level and nested in classes (not those made inside functions)."""
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield child
                todo.append(child)


def base_names(cls: ast.ClassDef) -> list[str]:
    named = [b for b in cls.bases if isinstance(b, ast.Name | ast.Attribute)]
    return [b.attr if isinstance(b, ast.Attribute) else b.id for b in named]


def test_public_classes_have_a_docstring() -> None:
    missing = []
    for path in product_files():
        for cls in classes(ast.parse(path.read_text(encoding="utf-8"))):
            if not cls.name.startswith("_") and ast.get_docstring(cls) is None:
                missing.append(f"{path.relative_to(REPO)}:{cls.lineno} {cls.name}")
    assert missing == [], "public classes without a docstring (one line is enough):\n" + "\n".join(missing)


def test_every_exception_derives_from_swectl_error_and_is_in_the_documented_tree() -> None:
    bases: dict[str, list[str]] = {}
    where: dict[str, str] = {}
    for path in product_files():
        if path.relative_to(REPO) in STDLIB_ONLY:
            continue
        for cls in classes(ast.parse(path.read_text(encoding="utf-8"))):
            bases[cls.name] = base_names(cls)
            where[cls.name] = f"{path.relative_to(REPO)}:{cls.lineno}"

    def chain(name: str) -> set[str]:
        seen: set[str] = set()
        todo = [name]
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo += bases.get(current, [])
        return seen

    def is_builtin_exception(name: str) -> bool:
        obj = getattr(builtins, name, None)
        return isinstance(obj, type) and issubclass(obj, BaseException)

    exceptions = {n for n in bases if any(is_builtin_exception(b) for b in chain(n))}
    assert "SwectlError" in exceptions
    outside = [f"{where[n]} {n}" for n in sorted(exceptions) if n != "SwectlError" and "SwectlError" not in chain(n)]
    assert outside == [], "exceptions outside the tree of swectl/errors.py:\n" + "\n".join(outside)
    documented = ast.get_docstring(ast.parse((REPO / "swectl" / "errors.py").read_text(encoding="utf-8"))) or ""
    public = sorted(n for n in exceptions if not n.startswith("_"))
    assert [n for n in public if n not in documented] == [], "add them to the tree in swectl/errors.py's docstring"
