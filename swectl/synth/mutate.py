"""Synthesised bugs: one small, valid mutation of one function of a Python source file.

Every mutation rewrites only the source span of the node it changes (``ast`` positions, converted from
UTF-8 byte columns to str offsets), so comments and formatting survive and the diff is a line or two.
A mutant is kept only if the mutated function still compiles and its AST differs from the original.

Kinds (``KINDS``):

- ``flip_comparison``: ``<``/``<=``, ``>``/``>=``, ``==``/``!=``, ``is``/``is not``, ``in``/``not in``.
- ``flip_boolean``: ``True``/``False``, ``and``/``or`` (all operators of one chain), dropping a ``not``.
- ``off_by_one``: an int literal used as an index, slice bound, ``range()`` argument, comparison operand or
  ``+``/``-`` operand becomes n+1 and n-1 (n-1 only when n >= 1).
- ``swap_arguments``: the first two positional arguments of a call trade places (skipped if equal text).
- ``remove_statement``: an expression statement, assignment, ``return``, ``raise``, ``continue`` or
  ``break`` of at most 4 lines in a block of at least two statements is deleted (its whole lines, or
  replaced by ``pass`` when it shares a line with other code).
- ``change_constant``: any other int literal n -> n+1, a finite float x -> x+1.0, a non-empty str/bytes
  literal loses its last character.
- ``flip_operator``: ``+``/``-``, ``*``/``/``, ``//`` -> ``/``, ``<<``/``>>``, ``&``/``|``, also augmented.

Not mutated: docstrings and other bare-constant statements, f-strings, annotations, decorators and default
values, and the bodies of nested functions and classes (those are functions of their own, named like
``code.co_qualname``: ``outer.<locals>.inner``).
"""

from __future__ import annotations

import ast
import bisect
import difflib
import hashlib
import math
import random
import re
from collections.abc import Iterator
from itertools import pairwise
from typing import Literal, NamedTuple, get_args

import msgspec

MutationKind = Literal[
    "flip_comparison",
    "flip_boolean",
    "off_by_one",
    "swap_arguments",
    "remove_statement",
    "change_constant",
    "flip_operator",
]
KINDS: tuple[MutationKind, ...] = get_args(MutationKind)
_KIND_ORDER = {kind: i for i, kind in enumerate(KINDS)}


class Mutant(msgspec.Struct, frozen=True):
    """One synthesised bug in ``function`` of ``path``. ``description`` is for logs, never for the agent."""

    path: str
    function: str
    kind: MutationKind
    line: int
    description: str
    original: str
    mutated: str

    def bug_patch(self) -> str:
        """The diff that introduces the bug (original -> mutated)."""
        return unified_diff(self.path, self.original, self.mutated)

    def fix_patch(self) -> str:
        """The gold patch: the reverse diff (mutated -> original)."""
        return unified_diff(self.path, self.mutated, self.original)


class FunctionInfo(msgspec.Struct, frozen=True):
    """A function or method. ``first_line`` is its first decorator line (else the def line), like
    ``code.co_firstlineno``; ``last_line`` is the line of its last token."""

    qualname: str
    first_line: int
    def_line: int
    last_line: int


# ---------------------------------------------------------------------------------------------- source text

_NEWLINE = re.compile(r"\r\n|\r|\n")
_COMMENT = re.compile(r"#[^\r\n]*")
_LINE_TAIL = re.compile(r"[ \t\f]*(?:#[^\r\n]*)?(?:\r\n|\r|\n)?")


class _Source:
    """Source text with ``ast`` position -> str offset conversion."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.line_starts = [0, *(m.end() for m in _NEWLINE.finditer(text))]

    def line_start(self, lineno: int) -> int:
        """Offset of the start of 1-based line ``lineno``; the text length past the last line."""
        return self.line_starts[lineno - 1] if lineno <= len(self.line_starts) else len(self.text)

    def offset(self, lineno: int, col: int) -> int:
        start = self.line_start(lineno)
        line = self.text[start : self.line_start(lineno + 1)]
        if line.isascii():
            return start + col
        return start + len(line.encode("utf-8")[:col].decode("utf-8", "replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        return start, self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]

    def line_of(self, offset: int) -> int:
        return bisect.bisect_right(self.line_starts, offset)

    def find_one(self, start: int, end: int, pattern: re.Pattern[str]) -> tuple[int, int] | None:
        """The only match of ``pattern`` in text[start:end] with comments blanked out, as offsets."""
        gap = _COMMENT.sub(lambda m: " " * len(m.group()), self.text[start:end])
        matches = list(pattern.finditer(gap))
        if len(matches) != 1:
            return None
        return start + matches[0].start(), start + matches[0].end()


def _short(text: str, limit: int = 40) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------- functions


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


_FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
_STMT_LISTS = ("body", "orelse", "finalbody", "handlers", "cases")


def _child_blocks(node: ast.AST) -> Iterator[list[ast.AST]]:
    for field in _STMT_LISTS:
        value = getattr(node, field, None)
        if isinstance(value, list):
            yield value


def _collect_functions(stmts: list[ast.AST], prefix: str, out: list[tuple[FunctionInfo, _FunctionNode]]) -> None:
    for node in stmts:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            qualname = prefix + node.name
            first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            out.append((FunctionInfo(qualname, first, node.lineno, node.end_lineno or node.lineno), node))
            _collect_functions(node.body, qualname + ".<locals>.", out)
        elif isinstance(node, ast.ClassDef):
            _collect_functions(node.body, prefix + node.name + ".", out)
        else:
            for block in _child_blocks(node):
                _collect_functions(block, prefix, out)


def _functions(tree: ast.Module) -> list[tuple[FunctionInfo, _FunctionNode]]:
    out: list[tuple[FunctionInfo, _FunctionNode]] = []
    _collect_functions(tree.body, "", out)
    return out


def find_functions(source: str) -> list[FunctionInfo]:
    """Every function and method (also nested ones, as ``outer.<locals>.inner``), in source order.

    Raises SyntaxError if ``source`` does not parse.
    """
    return [info for info, _ in _functions(ast.parse(source))]


def _mutable_body(func: _FunctionNode) -> list[ast.stmt]:
    """The body without its docstring; empty if the function does nothing (only pass / ... / docstring)."""
    body = func.body[1:] if _is_docstring(func.body[0]) else func.body
    inert = all(
        isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)) for s in body
    )
    return [] if inert else body


# ---------------------------------------------------------------------------------------------- mutation rules


class _Edit(NamedTuple):
    kind: MutationKind
    start: int
    end: int
    text: str
    at: int  # offset whose line is reported
    description: str


_CMP_TOKEN = re.compile(r"<=|>=|==|!=|<|>|\bis\s+not\b|\bnot\s+in\b|\bis\b|\bin\b")
_CMP_FLIP: dict[type[ast.cmpop], str] = {
    ast.Lt: "<=",
    ast.LtE: "<",
    ast.Gt: ">=",
    ast.GtE: ">",
    ast.Eq: "!=",
    ast.NotEq: "==",
    ast.Is: "is not",
    ast.IsNot: "is",
    ast.In: "not in",
    ast.NotIn: "in",
}
_BOOL_TOKEN = re.compile(r"\b(?:and|or)\b")
_BIN_TOKEN = re.compile(r"\*\*|//|<<|>>|[-+*/%@&|^]")
_AUG_TOKEN = re.compile(r"(?:\*\*|//|<<|>>|[-+*/%@&|^])=")
_OP_TEXT: dict[type[ast.operator], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitAnd: "&",
    ast.BitOr: "|",
}
_OP_FLIP = {"+": "-", "-": "+", "*": "/", "/": "*", "//": "/", "<<": ">>", ">>": "<<", "&": "|", "|": "&"}
_MAX_REMOVED_LINES = 4  # longer statements (a call spread over many lines) would make a large, obvious diff
_REMOVABLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return, ast.Raise, ast.Continue, ast.Break)
_STR_OPEN = re.compile(r"([rRbBuU]{0,2})('''|\"\"\"|'|\")")


def _flip_comparisons(src: _Source, node: ast.Compare) -> Iterator[_Edit]:
    operands = [node.left, *node.comparators]
    for i, op in enumerate(node.ops):
        found = src.find_one(src.span(operands[i])[1], src.span(operands[i + 1])[0], _CMP_TOKEN)
        if found is None:
            continue
        old, new = " ".join(src.text[found[0] : found[1]].split()), _CMP_FLIP[type(op)]
        yield _Edit("flip_comparison", found[0], found[1], new, found[0], f"`{old}` -> `{new}`")


def _flip_boolop(src: _Source, node: ast.BoolOp) -> Iterator[_Edit]:
    old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
    spots = [src.find_one(src.span(a)[1], src.span(b)[0], _BOOL_TOKEN) for a, b in pairwise(node.values)]
    if not spots or any(s is None for s in spots):
        return
    first, last = spots[0][0], spots[-1][1]  # type: ignore[index]
    pieces, cursor = [], first
    for start, end in spots:  # type: ignore[misc]
        pieces += [src.text[cursor:start], new]
        cursor = end
    yield _Edit("flip_boolean", first, last, "".join(pieces), first, f"`{old}` -> `{new}`")


def _drop_not(src: _Source, node: ast.UnaryOp) -> Iterator[_Edit]:
    start, end = src.span(node)
    text = src.text[start:end]
    if text.startswith("not") and text[3:4] in (" ", "\t", "("):
        yield _Edit("flip_boolean", start, end, text[3:].lstrip(" \t"), start, "dropped `not`")


def _int_in_offset_context(node: ast.Constant, parents: dict[int, ast.AST]) -> bool:
    child: ast.AST = node
    parent = parents.get(id(node))
    if isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.USub):
        child, parent = parent, parents.get(id(parent))
    if isinstance(parent, ast.Slice | ast.Compare):
        return True
    if isinstance(parent, ast.Subscript):
        return parent.slice is child
    if isinstance(parent, ast.BinOp | ast.AugAssign):
        return isinstance(parent.op, ast.Add | ast.Sub)
    if isinstance(parent, ast.Call):
        is_range = isinstance(parent.func, ast.Name) and parent.func.id == "range"
        return is_range and any(arg is child for arg in parent.args)
    return False


def _shorter_literal(text: str, value: str | bytes) -> str | None:
    """``text`` (a str/bytes literal, maybe implicitly concatenated) rewritten to evaluate to ``value[:-1]``:
    the last character, or escape sequence, before the closing quote goes. A one-line literal may instead be
    rewritten as ``repr``; None if neither works."""
    target = value[:-1]
    candidates = []
    opening = _STR_OPEN.match(text)
    if opening and text.endswith(opening.group(2)):
        quote = opening.group(2)
        candidates += [text[: -len(quote) - drop] + quote for drop in (1, 2, 4, 6, 10)]
    if "\n" not in text and "\r" not in text:
        candidates.append(repr(target))
    for candidate in candidates:
        try:
            result = ast.literal_eval(f"({candidate}\n)")  # parenthesized: the literal may span lines
        except (SyntaxError, ValueError):
            continue
        if type(result) is type(value) and result == target:
            return candidate
    return None


def _change_constant(src: _Source, node: ast.Constant, parents: dict[int, ast.AST]) -> Iterator[_Edit]:
    value = node.value
    start, end = src.span(node)
    old = src.text[start:end]
    if isinstance(value, bool):
        new = "False" if value else "True"
        yield _Edit("flip_boolean", start, end, new, start, f"`{old}` -> `{new}`")
    elif type(value) is int:
        if _int_in_offset_context(node, parents):
            for new_value in (value + 1, value - 1) if value >= 1 else (value + 1,):
                yield _Edit("off_by_one", start, end, str(new_value), start, f"`{old}` -> `{new_value}`")
        else:
            yield _Edit("change_constant", start, end, str(value + 1), start, f"`{old}` -> `{value + 1}`")
    elif type(value) is float and math.isfinite(value + 1.0):
        new = repr(value + 1.0)
        yield _Edit("change_constant", start, end, new, start, f"`{old}` -> `{new}`")
    elif isinstance(value, str | bytes) and value:
        new = _shorter_literal(old, value)
        if new is not None:
            yield _Edit("change_constant", start, end, new, start, f"`{_short(old)}` -> `{_short(new)}`")


def _swap_arguments(src: _Source, node: ast.Call) -> Iterator[_Edit]:
    if len(node.args) < 2 or any(isinstance(a, ast.Starred) for a in node.args[:2]):
        return
    (s0, e0), (s1, e1) = src.span(node.args[0]), src.span(node.args[1])
    first, second = src.text[s0:e0], src.text[s1:e1]
    if e0 > s1 or first == second:
        return
    desc = f"swapped arguments `{_short(first, 20)}` and `{_short(second, 20)}` of `{_short(src.segment(node.func))}()`"
    yield _Edit("swap_arguments", s0, e1, second + src.text[e0:s1] + first, s0, desc)


def _flip_operator(src: _Source, node: ast.BinOp | ast.AugAssign) -> Iterator[_Edit]:
    old = _OP_TEXT.get(type(node.op))
    if old is None:
        return
    if isinstance(node, ast.BinOp):
        found = src.find_one(src.span(node.left)[1], src.span(node.right)[0], _BIN_TOKEN)
        suffix = ""
    else:
        found = src.find_one(src.span(node.target)[1], src.span(node.value)[0], _AUG_TOKEN)
        suffix = "="
    if found is None or src.text[found[0] : found[1]] != old + suffix:
        return
    new = _OP_FLIP[old] + suffix
    yield _Edit("flip_operator", found[0], found[1], new, found[0], f"`{old}{suffix}` -> `{new}`")


def _removals(src: _Source, block: list[ast.AST]) -> Iterator[_Edit]:
    if len(block) < 2:
        return
    for stmt in block:
        if not isinstance(stmt, _REMOVABLE):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, ast.AnnAssign) and stmt.value is None:
            continue
        if stmt.end_lineno - stmt.lineno >= _MAX_REMOVED_LINES:  # type: ignore[operator]
            continue
        start, end = src.span(stmt)
        line_start, next_line = src.line_start(stmt.lineno), src.line_start(stmt.end_lineno + 1)  # type: ignore[operator]
        desc = f"removed `{_short(src.text[start:end].splitlines()[0])}`"
        alone = not src.text[line_start:start].strip() and _LINE_TAIL.fullmatch(src.text[end:next_line])
        if alone:
            yield _Edit("remove_statement", line_start, next_line, "", start, desc)
        else:
            yield _Edit("remove_statement", start, end, "pass", start, desc)


def _walk_body(body: list[ast.stmt]) -> Iterator[tuple[ast.AST, ast.AST | None]]:
    """(node, parent) for every node of ``body`` except nested defs/classes, f-strings and annotations."""
    stack: list[tuple[ast.AST, ast.AST | None]] = [(stmt, None) for stmt in reversed(body)]
    while stack:
        node, parent = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.JoinedStr):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        yield node, parent
        children = [
            child
            for field, value in ast.iter_fields(node)
            if not (isinstance(node, ast.AnnAssign) and field == "annotation")
            for child in (value if isinstance(value, list) else [value])
            if isinstance(child, ast.AST)
        ]
        stack.extend((child, node) for child in reversed(children))


def _function_edits(src: _Source, func: _FunctionNode) -> list[_Edit]:
    body = _mutable_body(func)
    if not body:
        return []
    nodes = list(_walk_body(body))
    parents = {id(node): parent for node, parent in nodes if parent is not None}
    edits = list(_removals(src, func.body))
    for node, _ in nodes:
        edits.extend(_node_edits(src, node, parents))
        for block in _child_blocks(node):
            edits.extend(_removals(src, block))
    return sorted(edits, key=lambda e: (e.start, _KIND_ORDER[e.kind], e.end, e.text))


def _node_edits(src: _Source, node: ast.AST, parents: dict[int, ast.AST]) -> Iterator[_Edit]:
    if isinstance(node, ast.Compare):
        yield from _flip_comparisons(src, node)
    elif isinstance(node, ast.BoolOp):
        yield from _flip_boolop(src, node)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield from _drop_not(src, node)
    elif isinstance(node, ast.Constant):
        yield from _change_constant(src, node, parents)
    elif isinstance(node, ast.Call):
        yield from _swap_arguments(src, node)
    elif isinstance(node, ast.BinOp | ast.AugAssign):
        yield from _flip_operator(src, node)


# ---------------------------------------------------------------------------------------------- validation


class _Checker:
    """Compiles a mutated function on its own (indented ones inside ``if True:``), or the whole file
    when the function's text does not compile alone; accepts it only if its AST differs."""

    def __init__(self, src: _Source, start: int, end: int, path: str) -> None:
        self.src, self.start, self.end, self.path = src, start, end, path
        text = src.text[start:end]
        self.prefix = "if True:\n" if text[:1] in (" ", "\t") else ""
        self.whole_file = False
        self.original = self._dump(text)
        if self.original is None:
            self.whole_file = True
            self.original = self._dump(text)

    def _dump(self, function_text: str) -> str | None:
        if self.whole_file:
            code = self.src.text[: self.start] + function_text + self.src.text[self.end :]
        else:
            code = self.prefix + function_text
        try:
            tree = ast.parse(code)
            compile(tree, self.path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError, RecursionError):
            return None
        return ast.dump(tree)

    def accepts(self, function_text: str) -> bool:
        if self.original is None:  # the file itself does not compile: nothing to compare with
            return False
        dump = self._dump(function_text)
        return dump is not None and dump != self.original


# ---------------------------------------------------------------------------------------------- public API


class _FunctionMutator:
    """Turns the candidate edits of one function into mutants, validating (and deduplicating) lazily."""

    def __init__(self, src: _Source, path: str, info: FunctionInfo, func: _FunctionNode) -> None:
        self.src, self.path, self.info = src, path, info
        self.start, self.end = src.line_start(info.first_line), src.line_start(info.last_line + 1)
        self.edits = _function_edits(src, func)
        self._checker: _Checker | None = None
        self._seen: set[str] = set()

    def realise(self, edit: _Edit) -> Mutant | None:
        """The mutant of ``edit``; None if it does not compile, changes nothing or repeats an earlier one."""
        text, start = self.src.text, self.start
        mutated_function = text[start : edit.start] + edit.text + text[edit.end : self.end]
        if mutated_function in self._seen:
            return None
        self._seen.add(mutated_function)
        if self._checker is None:
            self._checker = _Checker(self.src, start, self.end, self.path)
        if not self._checker.accepts(mutated_function):
            return None
        line, qualname = self.src.line_of(edit.at), self.info.qualname
        return Mutant(
            path=self.path,
            function=qualname,
            kind=edit.kind,
            line=line,
            description=f"{edit.description} in {qualname}, line {line}",
            original=text,
            mutated=text[:start] + mutated_function + text[self.end :],
        )

    def all(self) -> list[Mutant]:
        return [m for m in map(self.realise, self.edits) if m is not None]

    def pick(self, count: int, rng: random.Random) -> list[Mutant]:
        """Up to ``count`` mutants spread over kinds: kinds in random order, round robin, random within a kind;
        an edit that turns out invalid is replaced by another of its kind."""
        by_kind: dict[str, list[_Edit]] = {}
        for edit in self.edits:
            by_kind.setdefault(edit.kind, []).append(edit)
        kinds = sorted(by_kind)
        rng.shuffle(kinds)
        for kind in kinds:
            rng.shuffle(by_kind[kind])
        picked: list[Mutant] = []
        while len(picked) < count and any(by_kind.values()):
            for kind in kinds:
                while by_kind[kind] and len(picked) < count:
                    mutant = self.realise(by_kind[kind].pop())
                    if mutant is not None:
                        picked.append(mutant)
                        break
        return picked


def _mutators(source: str, path: str) -> list[_FunctionMutator]:
    src = _Source(source)
    return [_FunctionMutator(src, path, info, node) for info, node in _functions(ast.parse(source))]


def mutants_for_function(source: str, path: str, qualname: str, *, line: int | None = None) -> list[Mutant]:
    """Every valid single mutation of function ``qualname`` (``Class.method``, ``outer.<locals>.inner``), in
    source order. ``line`` (first line as in ``FunctionInfo.first_line`` / ``co_firstlineno``, or the def
    line) picks one of several same-named definitions (property setters, conditional defs); without it all
    are mutated. Raises ValueError if no such function exists, SyntaxError if ``source`` does not parse."""
    found = [
        mutator
        for mutator in _mutators(source, path)
        if mutator.info.qualname == qualname
        and (line is None or line in (mutator.info.first_line, mutator.info.def_line))
    ]
    if not found:
        raise ValueError(f"{path}: no function {qualname!r}" + (f" at line {line}" if line is not None else ""))
    return [mutant for mutator in found for mutant in mutator.all()]


def _subseed(seed: int, *parts: str) -> int:
    digest = hashlib.sha256("\x00".join([str(seed), *parts]).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def sample_mutants(
    source: str, path: str, functions: list[str] | None, seed: int, per_function: int = 1
) -> list[Mutant]:
    """Up to ``per_function`` mutants of each function in ``functions`` (qualnames; None: every function),
    spread over mutation kinds. Deterministic in (source, path, functions, seed, per_function); only the
    picked mutants are validated, so this is much cheaper than ``mutants_for_function``. Names that
    ``source`` does not define are skipped, so a coverage report's names can be passed as they are; a name
    defined more than once (property getter and setter) gets up to ``per_function`` from each definition."""
    mutators = _mutators(source, path)
    names = list(dict.fromkeys(m.info.qualname for m in mutators)) if functions is None else functions
    out: list[Mutant] = []
    for name in names:
        for mutator in (m for m in mutators if m.info.qualname == name):
            rng = random.Random(_subseed(seed, path, name, str(mutator.info.first_line)))
            out.extend(mutator.pick(per_function, rng))
    return out


# ---------------------------------------------------------------------------------------------- diffs


def _split_lines(text: str) -> list[str]:
    """Lines with their endings, split on "\\n" only, as git does ("\\r" stays part of its line)."""
    parts = text.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def unified_diff(path: str, before: str, after: str) -> str:
    """A git-style diff of one file (3 lines of context) that ``git apply`` accepts; "" if equal."""
    if before == after:
        return ""
    lines = [f"diff --git a/{path} b/{path}\n"]
    body = difflib.unified_diff(_split_lines(before), _split_lines(after), f"a/{path}", f"b/{path}", n=3)
    for line in body:
        lines.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(lines)


def changed_lines(before: str, after: str) -> list[str]:
    """The lines (without endings) that a change removed or added: what a problem statement must not quote."""
    old, new = _split_lines(before), _split_lines(after)
    out: list[str] = []
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            out += [line.rstrip("\r\n") for line in old[i1:i2] + new[j1:j2]]
    return out
