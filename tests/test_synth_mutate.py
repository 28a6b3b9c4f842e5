"""swectl.synth.mutate: every mutation kind on small sources, minimal diffs that `git apply` accepts,
determinism, and hundreds of mutants of real modules (stdlib, msgspec) that all compile."""

from __future__ import annotations

import ast
import shutil
import subprocess
import textwrap
from pathlib import Path

import msgspec
import pytest

from swectl.synth.mutate import (
    KINDS,
    FunctionInfo,
    Mutant,
    changed_lines,
    find_functions,
    mutants_for_function,
    sample_mutants,
    unified_diff,
)

SAMPLE = '''\
"""Module docstring."""
import os


def pluralize(word, n=2):
    """Docstring: return word < 'x' stays as it is."""
    # leading comment
    if n < 2 or word == "":
        return word
    for i in range(1, 3):
        if word[-1] is None:
            continue
    total = word[1:n] * 2.5  # trailing comment
    total += 1
    return os.path.join(word, "s")


class Cache:
    def __getitem__(self, key):
        if key in self._d and not (self.closed or self.stale):
            return self._d[key]
        value = self.load(key, 7)
        self.flag = True
        return value

    @property
    def size(self):
        return len(self._d) + 1

    @size.setter
    def size(self, value):
        self._d = value or {}

    class Inner:
        def deep(self, x):
            return x is not None and x not in self.seen


def outer(a):
    def inner(b):
        return b - 1
    return inner(a) >= 0


def stub():
    """Only a docstring and an ellipsis."""
    ...
'''


def _changes(mutants: list[Mutant]) -> set[tuple[str, tuple[str, ...]]]:
    return {(m.kind, tuple(line.strip() for line in changed_lines(m.original, m.mutated))) for m in mutants}


def _one_line_changes(mutants: list[Mutant], kind: str) -> set[tuple[str, str]]:
    """(old line, new line) of each mutant of ``kind`` that rewrote one line in place."""
    out = set()
    for m in mutants:
        lines = changed_lines(m.original, m.mutated)
        if m.kind == kind and len(lines) == 2:
            out.add((lines[0].strip(), lines[1].strip()))
    return out


def test_find_functions_qualnames_and_lines() -> None:
    infos = find_functions(SAMPLE)
    assert [(i.qualname, i.first_line, i.def_line) for i in infos] == [
        ("pluralize", 5, 5),
        ("Cache.__getitem__", 19, 19),
        ("Cache.size", 26, 27),
        ("Cache.size", 30, 31),
        ("Cache.Inner.deep", 35, 35),
        ("outer", 39, 39),
        ("outer.<locals>.inner", 40, 40),
        ("stub", 45, 45),
    ]
    assert infos[0].last_line == 15
    assert isinstance(infos[0], FunctionInfo)


def test_first_line_matches_code_firstlineno() -> None:
    namespace: dict[str, object] = {}
    exec(compile(SAMPLE, "sample.py", "exec"), namespace)
    cache = namespace["Cache"]
    getter = cache.size.fget.__code__  # type: ignore[attr-defined]
    setter = cache.size.fset.__code__  # type: ignore[attr-defined]
    by_line = {(i.qualname, i.first_line) for i in find_functions(SAMPLE)}
    assert (getter.co_qualname, getter.co_firstlineno) in by_line
    assert (setter.co_qualname, setter.co_firstlineno) in by_line


def test_flip_comparison() -> None:
    mutants = [
        *mutants_for_function(SAMPLE, "m.py", "pluralize"),
        *mutants_for_function(SAMPLE, "m.py", "Cache.Inner.deep"),
    ]
    changes = _one_line_changes(mutants, "flip_comparison")
    assert ('if n < 2 or word == "":', 'if n <= 2 or word == "":') in changes
    assert ('if n < 2 or word == "":', 'if n < 2 or word != "":') in changes
    assert ("if word[-1] is None:", "if word[-1] is not None:") in changes
    deep = "return x is not None and x not in self.seen"
    assert (deep, "return x is None and x not in self.seen") in changes
    assert (deep, "return x is not None and x in self.seen") in changes


def test_flip_boolean() -> None:
    mutants = mutants_for_function(SAMPLE, "m.py", "Cache.__getitem__")
    changes = _one_line_changes(mutants, "flip_boolean")
    cond = "if key in self._d and not (self.closed or self.stale):"
    assert (cond, "if key in self._d or not (self.closed or self.stale):") in changes
    assert (cond, "if key in self._d and not (self.closed and self.stale):") in changes
    # Dropping `not` keeps the parentheses, so the `or` stays grouped.
    assert (cond, "if key in self._d and (self.closed or self.stale):") in changes
    assert ("self.flag = True", "self.flag = False") in changes


def test_off_by_one() -> None:
    changes = _one_line_changes(mutants_for_function(SAMPLE, "m.py", "pluralize"), "off_by_one")
    assert ("for i in range(1, 3):", "for i in range(0, 3):") in changes
    assert ("for i in range(1, 3):", "for i in range(1, 4):") in changes
    assert ("if word[-1] is None:", "if word[-2] is None:") in changes
    assert ("total += 1", "total += 2") in changes
    trailing = "total = word[1:n] * 2.5  # trailing comment"
    assert (trailing, "total = word[2:n] * 2.5  # trailing comment") in changes
    assert ('if n < 2 or word == "":', 'if n < 3 or word == "":') in changes


def test_swap_arguments() -> None:
    mutants = mutants_for_function(SAMPLE, "m.py", "pluralize")
    mutants += mutants_for_function(SAMPLE, "m.py", "Cache.__getitem__")
    changes = _one_line_changes(mutants, "swap_arguments")
    assert ('return os.path.join(word, "s")', 'return os.path.join("s", word)') in changes
    assert ("value = self.load(key, 7)", "value = self.load(7, key)") in changes
    same = "def f(a):\n    g(a, a)\n    return h(a, a)\n"
    assert not [m for m in mutants_for_function(same, "m.py", "f") if m.kind == "swap_arguments"]


def test_remove_statement_whole_lines_and_only_statements_kept() -> None:
    mutants = [m for m in mutants_for_function(SAMPLE, "m.py", "pluralize") if m.kind == "remove_statement"]
    removed = {tuple(changed_lines(m.original, m.mutated)) for m in mutants}
    assert removed == {
        ("    total = word[1:n] * 2.5  # trailing comment",),
        ("    total += 1",),
        ('    return os.path.join(word, "s")',),
    }
    # `return word` and `continue` are the only statements of their blocks: never removed.
    for m in mutants:
        assert "return word\n" in m.mutated
        assert "continue\n" in m.mutated
        assert m.mutated.count("\n") == m.original.count("\n") - 1


def test_remove_statement_on_a_shared_line_becomes_pass() -> None:
    source = "def f(x):\n    a = 1; b = x\n    return a + b\n"
    changes = _changes(mutants_for_function(source, "m.py", "f"))
    assert ("remove_statement", ("a = 1; b = x", "pass; b = x")) in changes
    assert ("remove_statement", ("a = 1; b = x", "a = 1; pass")) in changes


def test_change_constant() -> None:
    source = textwrap.dedent(
        r'''
        def f(x):
            """Doc."""
            "a bare string statement"
            label = "abc"
            pattern = r"\d+"
            newline = "a\n"
            raw = b'xy'
            ratio = 0.5
            limit = 7
            return label, pattern, newline, raw, ratio, limit, x
        '''
    )
    changes = _one_line_changes(mutants_for_function(source, "m.py", "f"), "change_constant")
    assert changes == {
        ('label = "abc"', 'label = "ab"'),
        (r'pattern = r"\d+"', r'pattern = r"\d"'),
        (r'newline = "a\n"', 'newline = "a"'),
        ("raw = b'xy'", "raw = b'x'"),
        ("ratio = 0.5", "ratio = 1.5"),
        ("limit = 7", "limit = 8"),
    }


def test_flip_operator() -> None:
    changes = _one_line_changes(mutants_for_function(SAMPLE, "m.py", "pluralize"), "flip_operator")
    trailing = "total = word[1:n] * 2.5  # trailing comment"
    assert changes == {(trailing, "total = word[1:n] / 2.5  # trailing comment"), ("total += 1", "total -= 1")}


def test_all_kinds_appear_and_docstrings_are_untouched() -> None:
    mutants = [m for info in find_functions(SAMPLE) for m in mutants_for_function(SAMPLE, "m.py", info.qualname)]
    assert {m.kind for m in mutants} == set(KINDS)
    for m in mutants:
        assert '"""Docstring: return word < \'x\' stays as it is."""' in m.mutated
        assert "# leading comment" in m.mutated
        # A comment goes only with the line of a removed statement.
        assert "# trailing comment" in m.mutated or m.description.startswith("removed `total = word[1:n]")
        assert m.mutated != m.original
        ast.parse(m.mutated)
        assert msgspec.json.decode(msgspec.json.encode(m), type=Mutant) == m


def test_description_and_line() -> None:
    mutants = mutants_for_function(SAMPLE, "m.py", "pluralize")
    first = next(m for m in mutants if m.kind == "flip_comparison")
    assert first.description == "`<` -> `<=` in pluralize, line 8"
    assert first.line == 8
    assert first.function == "pluralize"
    assert first.path == "m.py"
    for m in mutants:
        assert m.original.splitlines()[m.line - 1] != m.mutated.splitlines()[m.line - 1] or m.kind == "remove_statement"


def test_nested_functions_are_their_own() -> None:
    outer = _changes(mutants_for_function(SAMPLE, "m.py", "outer"))
    inner = _changes(mutants_for_function(SAMPLE, "m.py", "outer.<locals>.inner"))
    assert ("flip_comparison", ("return inner(a) >= 0", "return inner(a) > 0")) in outer
    assert all("b - 1" not in line for _, lines in outer for line in lines)
    assert ("flip_operator", ("return b - 1", "return b + 1")) in inner


def test_inert_functions_and_unknown_names() -> None:
    assert mutants_for_function(SAMPLE, "m.py", "stub") == []
    assert mutants_for_function("def f():\n    pass\n", "m.py", "f") == []
    with pytest.raises(ValueError, match="nope"):
        mutants_for_function(SAMPLE, "m.py", "nope")


def test_line_picks_one_of_same_named_definitions() -> None:
    both = mutants_for_function(SAMPLE, "m.py", "Cache.size")
    getter = mutants_for_function(SAMPLE, "m.py", "Cache.size", line=26)
    setter = mutants_for_function(SAMPLE, "m.py", "Cache.size", line=31)  # the def line works too
    assert getter
    assert setter
    assert len(both) == len(getter) + len(setter)
    assert all(27 <= m.line <= 28 for m in getter)
    assert all(31 <= m.line <= 32 for m in setter)


def test_non_ascii_columns() -> None:
    source = 'def f(x):\n    s = "héllo wörld" + x  # ünïcode\n    return s[1:] if len(s) > 3 else s\n'
    changes = _changes(mutants_for_function(source, "m.py", "f"))
    assert ("flip_operator", ('s = "héllo wörld" + x  # ünïcode', 's = "héllo wörld" - x  # ünïcode')) in changes
    assert ("change_constant", ('s = "héllo wörld" + x  # ünïcode', 's = "héllo wörl" + x  # ünïcode')) in changes
    last = "return s[1:] if len(s) > 3 else s"
    assert ("flip_comparison", (last, "return s[1:] if len(s) >= 3 else s")) in changes


def test_mutations_that_would_not_compile_are_dropped() -> None:
    # Removing `x = 0` would leave `nonlocal x` without a binding: a SyntaxError at compile time.
    source = "def f():\n    x = 0\n    y = 1\n    def g():\n        nonlocal x\n        x += y\n    return g\n"
    removed = [m for m in mutants_for_function(source, "m.py", "f") if m.kind == "remove_statement"]
    assert {tuple(changed_lines(m.original, m.mutated)) for m in removed} == {("    y = 1",), ("    return g",)}


def test_sample_is_deterministic_and_spread_over_kinds() -> None:
    source = Path(textwrap.__file__).read_text()
    first = sample_mutants(source, "textwrap.py", None, seed=7, per_function=3)
    again = sample_mutants(source, "textwrap.py", None, seed=7, per_function=3)
    other = sample_mutants(source, "textwrap.py", None, seed=8, per_function=3)
    assert first == again
    assert [m.mutated for m in first] != [m.mutated for m in other]
    by_function: dict[str, list[Mutant]] = {}
    for m in first:
        by_function.setdefault(m.function, []).append(m)
    assert all(len(ms) <= 3 for ms in by_function.values())
    # With enough candidates, the three picks of a function are of three different kinds.
    pool = mutants_for_function(source, "textwrap.py", "TextWrapper._wrap_chunks")
    assert len({m.kind for m in pool}) >= 3
    assert len({m.kind for m in by_function["TextWrapper._wrap_chunks"]}) == 3


def test_sample_named_functions_skips_unknown_names() -> None:
    picked = sample_mutants(SAMPLE, "m.py", ["Cache.__getitem__", "not_there", "pluralize"], seed=1, per_function=2)
    assert [m.function for m in picked] == ["Cache.__getitem__"] * 2 + ["pluralize"] * 2
    assert sample_mutants(SAMPLE, "m.py", ["stub"], seed=1, per_function=2) == []


def _real_sources() -> list[Path]:
    msgspec_dir = Path(msgspec.__file__).parent
    return [Path(textwrap.__file__), msgspec_dir / "_json_schema.py", msgspec_dir / "inspect.py"]


def _touched_lines(before: str, after: str) -> range:
    """1-based lines of ``before`` between the first and the last that differ (an insertion: the line after)."""
    old, new = before.splitlines(), after.splitlines()
    head = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), min(len(old), len(new)))
    tail = 0
    while tail < min(len(old), len(new)) - head and old[-1 - tail] == new[-1 - tail]:
        tail += 1
    return range(head + 1, max(head + 1, len(old) - tail) + 1)


@pytest.mark.parametrize("path", _real_sources(), ids=lambda p: p.name)
def test_real_module_mutants_compile_and_stay_small(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    spans: dict[str, list[tuple[int, int]]] = {}
    for info in find_functions(source):
        spans.setdefault(info.qualname, []).append((info.first_line, info.last_line))
    mutants = sample_mutants(source, path.name, None, seed=0, per_function=1000)
    assert len(mutants) > 150
    assert len({m.mutated for m in mutants}) == len(mutants)
    for m in mutants:
        compile(m.mutated, path.name, "exec", dont_inherit=True)
        assert 1 <= len(changed_lines(m.original, m.mutated)) <= 8, m.description
        touched = _touched_lines(m.original, m.mutated)
        assert m.line in touched, m.description
        assert any(first <= line <= last for line in touched for first, last in spans[m.function]), m.description


# ---------------------------------------------------------------------------------------------- diffs

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git_apply(repo: Path, patch: str, *, reverse: bool = False) -> None:
    (repo / "p.diff").write_text(patch, newline="")
    args = ["git", "apply", "--whitespace=nowarn", *(["-R"] if reverse else []), "p.diff"]
    subprocess.run(args, cwd=repo, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    return tmp_path


@needs_git
@pytest.mark.parametrize(
    "source",
    [SAMPLE, SAMPLE.rstrip("\n"), SAMPLE.replace("\n", "\r\n")],
    ids=["newline-at-end", "no-newline-at-end", "crlf"],
)
def test_unified_diff_applies_with_git(repo: Path, source: str) -> None:
    mutants = [m for info in find_functions(source) for m in mutants_for_function(source, "pkg/m.py", info.qualname)]
    target = repo / "pkg" / "m.py"
    target.parent.mkdir()
    checked = 0
    for m in mutants[:: max(1, len(mutants) // 25)] + mutants[-3:]:
        target.write_bytes(m.original.encode())
        _git_apply(repo, m.bug_patch())
        assert target.read_bytes().decode() == m.mutated
        _git_apply(repo, m.fix_patch())
        assert target.read_bytes().decode() == m.original
        checked += 1
    assert checked >= 20


def test_unified_diff_format() -> None:
    before = "a\nb\nc\nd\ne\nf\ng\nh\n"
    after = before.replace("e\n", "E\n")
    assert unified_diff("x/y.py", before, after) == (
        "diff --git a/x/y.py b/x/y.py\n--- a/x/y.py\n+++ b/x/y.py\n@@ -2,7 +2,7 @@\n b\n c\n d\n-e\n+E\n f\n g\n h\n"
    )
    assert unified_diff("x.py", before, before) == ""


def test_unified_diff_marks_missing_newline() -> None:
    diff = unified_diff("x.py", "a\nb", "a\nc")
    assert diff.endswith("-b\n\\ No newline at end of file\n+c\n\\ No newline at end of file\n")
    added = unified_diff("x.py", "a\nb", "a\nb\n")
    assert added.endswith("-b\n\\ No newline at end of file\n+b\n")


@needs_git
def test_unified_diff_newline_changes_apply(repo: Path) -> None:
    target = repo / "x.py"
    for before, after in [("a\nb", "a\nb\n"), ("a\nb\n", "a\nb"), ("", "x\n"), ("x = 1\r\n", "x = 2\r\n")]:
        target.write_bytes(before.encode())
        _git_apply(repo, unified_diff("x.py", before, after))
        assert target.read_bytes().decode() == after


def test_changed_lines() -> None:
    assert changed_lines("a\nb\nc\n", "a\nB\nc\n") == ["b", "B"]
    assert changed_lines("a\nb\nc\n", "a\nc\n") == ["b"]
    assert changed_lines("a\n", "a\n") == []
