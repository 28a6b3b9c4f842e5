"""Unified diffs: reversing one (``git apply -R`` as text).

SWE-smith rows carry the diff that *introduces* the bug; swectl's ``Task.patch`` is the fix, so the loader
reverses it here. Pure functions on ``str``; lines are split on ``\\n`` only, so ``\\r``, form feeds and other
bytes inside lines survive untouched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from swectl.errors import SwectlError

_HUNK = re.compile(r"^@@ -(\d+(?:,\d+)?) \+(\d+(?:,\d+)?) @@(.*)$")
_INDEX = re.compile(r"^index ([0-9a-fA-F]+)\.\.([0-9a-fA-F]+)(.*)$")
_GIT_HEADER_SWAPS = {
    "new file mode ": "deleted file mode ",
    "deleted file mode ": "new file mode ",
}
_NO_NEWLINE = "\\"  # "\ No newline at end of file" (the text after the backslash varies by locale)


class DiffError(SwectlError, ValueError):
    """A diff cannot be parsed or cannot be reversed; the message names the line."""


def reverse_diff(diff: str) -> str:
    """The diff that undoes ``diff``: ---/+++ and -/+ swapped, hunk ranges swapped, new <-> deleted files,
    mode and rename headers swapped, "No newline at end of file" markers kept with their line.

    Within each run of changed lines the removals come first, as ``git diff`` writes them, so reversing twice
    gives back a diff written by git byte for byte. Copies and binary patches raise DiffError.
    """
    if not diff:
        return diff
    trailing_newline = diff.endswith("\n")
    lines = diff.split("\n")
    if trailing_newline:
        lines.pop()
    out = _Reverser(lines).run()
    return "\n".join(out) + ("\n" if trailing_newline else "")


@dataclass
class _Change:
    """One changed line plus the "\\ No newline" marker that may follow it."""

    sign: str
    text: str
    marker: str | None = None

    def lines(self) -> list[str]:
        return [self.sign + self.text] + ([self.marker] if self.marker is not None else [])


@dataclass
class _Reverser:
    lines: list[str]
    pos: int = 0
    out: list[str] = field(default_factory=list)
    # Header lines of the current file section (from "diff --git" up to its first hunk), rewritten at the end.
    section: list[str] = field(default_factory=list)

    def run(self) -> list[str]:
        while self.pos < len(self.lines):
            line = self.lines[self.pos]
            if line.startswith("diff --git "):
                self._flush_section()
                self.section.append(line)
                self.pos += 1
            elif line.startswith("--- ") and self._peek(1).startswith("+++ "):
                self.section += [line, self._peek(1)]
                self.pos += 2
            elif line.startswith("@@ "):
                self._flush_section()
                self._hunk()
            elif line.startswith(("@@@ ", "diff --cc ", "diff --combined ")):
                raise DiffError(f"line {self.pos + 1}: combined (merge) diffs cannot be reversed")
            elif line.startswith("GIT binary patch") or (line.startswith("Binary files ") and " differ" in line):
                raise DiffError(f"line {self.pos + 1}: binary patches cannot be reversed")
            else:
                (self.section if self.section else self.out).append(line)
                self.pos += 1
        self._flush_section()
        return self.out

    def _peek(self, offset: int) -> str:
        index = self.pos + offset
        return self.lines[index] if index < len(self.lines) else ""

    def _flush_section(self) -> None:
        if self.section:
            self.out += _reverse_header(self.section, self.pos - len(self.section) + 1)
            self.section = []

    def _hunk(self) -> None:
        start = self.pos + 1
        match = _HUNK.match(self.lines[self.pos])
        if not match:
            raise DiffError(f"line {start}: malformed hunk header {self.lines[self.pos]!r}")
        old_range, new_range, tail = match.groups()
        old_left, new_left = _count(old_range), _count(new_range)
        self.out.append(f"@@ -{new_range} +{old_range} @@{tail}")
        self.pos += 1
        run: list[_Change] = []
        while old_left > 0 or new_left > 0:
            if self.pos >= len(self.lines):
                raise DiffError(f"line {start}: hunk ends early; {old_left} old and {new_left} new lines missing")
            line = self.lines[self.pos]
            sign, text = (line[:1], line[1:]) if line else (" ", None)
            if sign == " ":
                self._emit_run(run)
                self.out.append(line)
                old_left, new_left = old_left - 1, new_left - 1
            elif sign in ("-", "+"):
                run.append(_Change("+" if sign == "-" else "-", text or ""))
                old_left, new_left = (old_left - 1, new_left) if sign == "-" else (old_left, new_left - 1)
            elif sign == _NO_NEWLINE:
                self._attach_marker(run, line)
            else:
                raise DiffError(f"line {self.pos + 1}: expected a hunk line (' ', '-' or '+'), got {line!r}")
            if old_left < 0 or new_left < 0:
                raise DiffError(f"line {self.pos + 1}: hunk starting at line {start} has more lines than its header")
            self.pos += 1
        # A marker for the hunk's last line comes after the counts are used up.
        if self._peek(0).startswith(_NO_NEWLINE):
            self._attach_marker(run, self._peek(0))
            self.pos += 1
        self._emit_run(run)

    def _attach_marker(self, run: list[_Change], line: str) -> None:
        if run:
            run[-1].marker = line
        else:  # after a context line: it stays where it is
            self.out.append(line)

    def _emit_run(self, run: list[_Change]) -> None:
        for change in [c for c in run if c.sign == "-"] + [c for c in run if c.sign == "+"]:
            self.out += change.lines()
        run.clear()


def _count(spec: str) -> int:
    return int(spec.split(",")[1]) if "," in spec else 1


def _reverse_header(section: list[str], first_line: int) -> list[str]:
    """Rewrite one file section's header lines (``diff --git``, extended headers, ``---``/``+++``)."""
    out = list(section)
    renames: dict[str, tuple[int, str]] = {}
    for i, line in enumerate(section):
        for prefix, swapped in _GIT_HEADER_SWAPS.items():
            if line.startswith(prefix):
                out[i] = swapped + line[len(prefix) :]
        if line.startswith(("copy from ", "copy to ")):
            raise DiffError(f"line {first_line + i}: a copy cannot be reversed (it would need the copied file)")
        if line.startswith(("rename from ", "rename to ")):
            kind, _, path = line.partition(" ")[2].partition(" ")
            renames[kind] = (i, path)
        index = _INDEX.match(line)
        if index:
            out[i] = f"index {index.group(2)}..{index.group(1)}{index.group(3)}"
    _swap_pair(out, section, "old mode ", "new mode ")
    if {"from", "to"} <= renames.keys():
        (i_from, old), (i_to, new) = renames["from"], renames["to"]
        out[i_from], out[i_to] = f"rename from {new}", f"rename to {old}"
    _swap_file_lines(out, section)
    for i, line in enumerate(section):
        if line.startswith("diff --git "):
            out[i] = "diff --git " + _swap_git_paths(line[len("diff --git ") :], renames, first_line + i)
    return out


def _swap_pair(out: list[str], section: list[str], first: str, second: str) -> None:
    at = {prefix: i for i, line in enumerate(section) for prefix in (first, second) if line.startswith(prefix)}
    if first in at and second in at:
        a, b = at[first], at[second]
        out[a], out[b] = first + section[b][len(second) :], second + section[a][len(first) :]


def _swap_file_lines(out: list[str], section: list[str]) -> None:
    old_at = next((i for i, line in enumerate(section) if line.startswith("--- ")), None)
    if old_at is None or old_at + 1 >= len(section) or not section[old_at + 1].startswith("+++ "):
        return
    old, new = section[old_at][4:], section[old_at + 1][4:]
    git_prefixes = _has_prefix(old, "a/") and _has_prefix(new, "b/")
    old, new = new, old
    if git_prefixes:
        old, new = _replace_prefix(old, "b/", "a/"), _replace_prefix(new, "a/", "b/")
    out[old_at], out[old_at + 1] = "--- " + old, "+++ " + new


def _has_prefix(path: str, prefix: str) -> bool:
    return path.startswith("/dev/null") or path.lstrip('"').startswith(prefix)


def _replace_prefix(path: str, old: str, new: str) -> str:
    quote = '"' if path.startswith('"') else ""
    body = path[len(quote) :]
    return quote + new + body[len(old) :] if body.startswith(old) else path


def _swap_git_paths(rest: str, renames: dict[str, tuple[int, str]], line_no: int) -> str:
    left, right = _split_git_paths(rest, renames, line_no)
    if _has_prefix(left, "a/") and _has_prefix(right, "b/"):
        return f"{_replace_prefix(right, 'b/', 'a/')} {_replace_prefix(left, 'a/', 'b/')}"
    return f"{right} {left}"


def _split_git_paths(rest: str, renames: dict[str, tuple[int, str]], line_no: int) -> tuple[str, str]:
    """Split ``a/X b/Y`` into its two paths; spaces in paths make this ambiguous, so use what else we know."""
    if rest.startswith('"'):
        end = _quoted_end(rest)
        return rest[: end + 1], rest[end + 2 :]
    spaces = [i for i, ch in enumerate(rest) if ch == " "]
    for i in spaces:  # the usual case: the same path on both sides, under different prefixes
        left, right = rest[:i], rest[i + 1 :]
        if left.partition("/")[2] == right.partition("/")[2] and "/" in left and "/" in right:
            return left, right
    if {"from", "to"} <= renames.keys():
        old, new = renames["from"][1], renames["to"][1]
        for i in spaces:
            if rest[:i].endswith(old) and rest[i + 1 :].endswith(new):
                return rest[:i], rest[i + 1 :]
    if len(spaces) == 1:
        return rest[: spaces[0]], rest[spaces[0] + 1 :]
    raise DiffError(f"line {line_no}: cannot tell the two paths apart in 'diff --git {rest}'")


def _quoted_end(text: str) -> int:
    i = 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i
        i += 1
    raise DiffError(f"unterminated quoted path in {text!r}")


def drop_additions(diff: str) -> str:
    """``diff`` (a git diff) with its added lines left out: the removals alone, hunk ranges recounted; "" when
    nothing is left.

    A wrong but applicable patch made from a gold patch (it deletes what the fix replaces and adds nothing), for
    checking that two graders agree on a failed fix. Hunks that only add, and new files, are dropped; a file
    section left without hunks is dropped with its header."""
    out: list[str] = []
    for section in re.split(r"^(?=diff --git )", diff, flags=re.MULTILINE):
        lines = section.split("\n")
        first = next((n for n, line in enumerate(lines) if _HUNK.match(line)), None)
        if first is None:
            continue
        hunks: list[str] = []
        offset = 0  # new-file lines minus old-file lines before the current hunk
        n = first
        while n < len(lines):
            match = _HUNK.match(lines[n])
            if match is None:
                n += 1
                continue
            old_start, old_count = int(match.group(1).split(",")[0]), _count(match.group(1))
            body: list[str] = []
            n += 1
            while n < len(lines) and lines[n][:1] in (" ", "-", "+", _NO_NEWLINE) and not _HUNK.match(lines[n]):
                if lines[n].startswith("+"):
                    n += 1 + (n + 1 < len(lines) and lines[n + 1].startswith(_NO_NEWLINE))
                    continue
                body.append(lines[n])
                n += 1
            context = sum(line.startswith(" ") for line in body)
            if any(line.startswith("-") for line in body):
                new_start = old_start + offset - (context == 0)
                hunks += [f"@@ -{match.group(1)} +{new_start},{context} @@{match.group(3)}", *body]
            offset += context - old_count
        if hunks:
            out += [*lines[:first], *hunks]
    return "\n".join(out) + "\n" if out else ""
