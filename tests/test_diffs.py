"""swectl.diffs.reverse_diff: exact text cases, git's own reverse as the oracle, and `git apply` round trips."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from swectl.tasks.diffs import DiffError, drop_additions, reverse_diff

NO_NEWLINE_FIX = """\
diff --git a/f.txt b/f.txt
--- a/f.txt
+++ b/f.txt
@@ -1,2 +1,2 @@
 one
-two
\\ No newline at end of file
+two
"""

NO_NEWLINE_FIX_REVERSED = """\
diff --git a/f.txt b/f.txt
--- a/f.txt
+++ b/f.txt
@@ -1,2 +1,2 @@
 one
-two
+two
\\ No newline at end of file
"""


def test_no_newline_marker_stays_with_its_line() -> None:
    assert reverse_diff(NO_NEWLINE_FIX) == NO_NEWLINE_FIX_REVERSED
    assert reverse_diff(NO_NEWLINE_FIX_REVERSED) == NO_NEWLINE_FIX


def test_new_file_becomes_deleted_file() -> None:
    forward = (
        "diff --git a/new.py b/new.py\nnew file mode 100644\nindex 0000000..3b18e51\n"
        "--- /dev/null\n+++ b/new.py\n@@ -0,0 +1,2 @@\n+a = 1\n+b = 2\n"
    )
    expected = (
        "diff --git a/new.py b/new.py\ndeleted file mode 100644\nindex 3b18e51..0000000\n"
        "--- a/new.py\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-a = 1\n-b = 2\n"
    )
    assert reverse_diff(forward) == expected
    assert reverse_diff(expected) == forward


def test_hunk_ranges_swap_and_changes_reorder_removals_first() -> None:
    forward = "--- a/x\n+++ b/x\n@@ -3 +3,2 @@ def f():\n-old\n+new1\n+new2\n"
    assert reverse_diff(forward) == "--- a/x\n+++ b/x\n@@ -3,2 +3 @@ def f():\n-new1\n-new2\n+old\n"


def test_a_removed_line_that_looks_like_a_header_is_not_one() -> None:
    # Removing the line "-- x" gives the diff line "--- x": only the hunk's line counts tell it apart.
    forward = "--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n--- x\n+++ y\n keep\n"
    assert reverse_diff(forward) == "--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n-++ y\n+-- x\n keep\n"


def test_plain_diff_headers_with_timestamps_swap_whole() -> None:
    forward = "--- f.orig\t2024-01-01 00:00:00\n+++ f\t2024-01-02 00:00:00\n@@ -1 +1 @@\n-a\n+b\n"
    reversed_ = reverse_diff(forward)
    assert reversed_.splitlines()[:2] == ["--- f\t2024-01-02 00:00:00", "+++ f.orig\t2024-01-01 00:00:00"]


def test_text_outside_hunks_and_carriage_returns_survive() -> None:
    forward = "From: someone\n\nsubject\n---\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\r\n+b\x0c\r\n-- \n2.39.5\n"
    reversed_ = reverse_diff(forward)
    assert reversed_.startswith("From: someone\n\nsubject\n---\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-b\x0c\r\n+a\r\n")
    assert reversed_.endswith("-- \n2.39.5\n")
    assert reverse_diff(reversed_) == forward


@pytest.mark.parametrize(
    ("diff", "match"),
    [
        ("--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n-b\n+c\n", "ends early"),
        ("--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n a\n?b\n", "expected a hunk line"),
        ("--- a/x\n+++ b/x\n@@ -1,x +1 @@\n-a\n+b\n", "malformed hunk header"),
        ("diff --git a/i.png b/i.png\nindex 1..2 100644\nGIT binary patch\nliteral 1\n", "binary"),
        ("diff --git a/x b/y\nsimilarity index 90%\ncopy from x\ncopy to y\n", "copy"),
        ("diff --cc f\n@@@ -1,1 -1,1 +1,1 @@@\n", "combined"),
    ],
)
def test_unreversible_or_malformed_diffs_raise(diff: str, match: str) -> None:
    with pytest.raises(DiffError, match=match):
        reverse_diff(diff)


def test_empty_diff() -> None:
    assert reverse_diff("") == ""


def test_every_verified_patch_round_trips(verified_path: Path) -> None:
    checked = 0
    for line in verified_path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        for name in ("patch", "test_patch"):
            reversed_ = reverse_diff(row[name])
            assert reversed_ != row[name]
            assert _lines(reversed_, "+") == _lines(row[name], "-"), (row["instance_id"], name)
            assert _lines(reversed_, "-") == _lines(row[name], "+"), (row["instance_id"], name)
            assert reverse_diff(reversed_) == row[name], (row["instance_id"], name)
            checked += 1
    assert checked == 1000


def _lines(diff: str, sign: str) -> list[str]:
    header = "+++ " if sign == "+" else "--- "
    return [line[1:] for line in diff.split("\n") if line.startswith(sign) and not line.startswith(header)]


# ------------------------------------------------------------------------------ git apply in a real repository

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")


def _git(repo: Path, *args: str, stdin: str | None = None) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    # Bytes, not text=True: universal newlines would turn the CRLF lines of a diff into LF.
    done = subprocess.run(
        ["git", "-C", str(repo), *args],
        input=stdin.encode() if stdin is not None else None,
        capture_output=True,
        env=env,
        check=False,
    )
    assert done.returncode == 0, f"git {' '.join(args)} failed: {done.stderr.decode(errors='replace')}"
    return done.stdout.decode()


def _tree(repo: Path) -> str:
    _git(repo, "add", "-A")
    return _git(repo, "write-tree").strip()


def _write(repo: Path, files: dict[str, str | None]) -> None:
    for name, text in files.items():
        path = repo / name
        if text is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode())


BEFORE = {
    "mod.py": "".join(f"line {i}\n" for i in range(1, 40)),
    "gone.txt": "delete me\nplease\n",
    "tail.txt": "first\nlast without newline",
    "grows.txt": "has newline\n",
    "old_name.py": "".join(f"keep {i}\n" for i in range(20)),
    "crlf.txt": "a\r\nb\r\nc\r\n",
    "run.sh": "#!/bin/sh\necho hi\n",
    "dashes.txt": "-- x\n++ y\nkeep\n",
}
AFTER = {
    "mod.py": BEFORE["mod.py"].replace("line 3\n", "line three\n").replace("line 30\n", "") + "appended\n",
    "gone.txt": None,
    "added/new.txt": "brand\nnew\n",
    "empty.txt": "",
    "tail.txt": "first\nlast changed, still no newline",
    "grows.txt": "has newline\nno newline now",
    "old_name.py": None,
    "new_name.py": "".join(f"keep {i}\n" for i in range(20)).replace("keep 7\n", "changed 7\n"),
    "crlf.txt": "a\r\nB\r\nc\r\n",
    "dashes.txt": "keep\n",
}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.com")
    _git(tmp_path, "config", "user.name", "t")
    _write(tmp_path, BEFORE)
    (tmp_path / "run.sh").chmod(0o644)
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "before")
    return tmp_path


@needs_git
def test_git_apply_forward_then_reversed_restores_the_tree(repo: Path) -> None:
    original = _tree(repo)
    _write(repo, AFTER)
    (repo / "run.sh").chmod(0o755)
    changed = _tree(repo)
    forward = _git(repo, "diff", "--cached", "-M", "HEAD")
    assert "rename from old_name.py" in forward
    assert "new file mode" in forward
    assert "deleted file mode" in forward
    assert "\\ No newline at end of file" in forward
    assert "old mode 100644" in forward
    _git(repo, "reset", "-q", "--hard", "HEAD")
    assert _tree(repo) == original

    _git(repo, "apply", "--index", "-", stdin=forward)
    assert _tree(repo) == changed
    _git(repo, "apply", "--index", "-", stdin=reverse_diff(forward))
    assert _tree(repo) == original


@needs_git
def test_reverse_of_diff_a_b_is_git_diff_b_a(repo: Path) -> None:
    _write(repo, AFTER)
    (repo / "run.sh").chmod(0o755)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "after")
    forward = _git(repo, "diff", "-M", "HEAD~1", "HEAD")
    by_git = _git(repo, "diff", "-M", "HEAD", "HEAD~1")
    # git orders files by path and takes hunk headings from the preimage; compare per file, headings cut.
    assert _by_file(reverse_diff(forward)) == _by_file(by_git)


def _by_file(diff: str) -> dict[str, list[str]]:
    files: dict[str, list[str]] = {}
    current: list[str] = []
    for line in diff.split("\n"):
        if line.startswith("diff --git "):
            current = files.setdefault(line, [])
        current.append(line.split(" @@")[0] + " @@" if line.startswith("@@ ") else line)
    return files


@needs_git
def test_reversed_patch_applies_to_the_changed_tree_without_the_forward_patch(repo: Path) -> None:
    # Like a SWE-smith task: the tree already holds the bug; the reversed bug patch must apply on its own.
    _write(repo, {"mod.py": BEFORE["mod.py"].replace("line 5\n", "line five (bug)\n")})
    bug = _git(repo, "diff", "HEAD")
    _git(repo, "commit", "-qam", "bug")
    _git(repo, "apply", "--check", "-", stdin=reverse_diff(bug))
    _git(repo, "apply", "-", stdin=reverse_diff(bug))
    assert (repo / "mod.py").read_text() == BEFORE["mod.py"]


@needs_git
def test_drop_additions_applies_and_removes_only(repo: Path) -> None:
    _write(repo, AFTER)
    (repo / "run.sh").chmod(0o755)
    forward = _git(repo, "diff", "-M", "HEAD")
    _git(repo, "reset", "-q", "--hard", "HEAD")
    wrong = drop_additions(forward)
    assert wrong and "added/new.txt" not in wrong  # a new file only adds
    assert not [ln for ln in wrong.split("\n") if ln.startswith("+") and not ln.startswith("+++")]
    _git(repo, "apply", "--index", "-", stdin=wrong)
    mod = (repo / "mod.py").read_text()
    assert "line 3\n" not in mod and "line three" not in mod and "line 30\n" not in mod and "appended" not in mod
    assert not (repo / "gone.txt").exists()


def test_drop_additions_recounts_every_verified_hunk(verified_path: Path) -> None:
    def count(spec: str) -> int:
        return int(spec.split(",")[1]) if "," in spec else 1

    rows = [json.loads(line) for line in verified_path.read_text().splitlines()]
    for row in rows:
        header, body = "", []
        for line in [*drop_additions(row["patch"]).split("\n"), "@@ -0 +0 @@"]:
            assert not (line.startswith("+") and not line.startswith("+++")), row["instance_id"]
            if line.startswith("@@ "):
                if header:
                    old, new = header.split()[1:3]
                    assert sum(b[:1] in (" ", "-") for b in body) == count(old), (row["instance_id"], header)
                    assert sum(b[:1] == " " for b in body) == count(new), (row["instance_id"], header)
                header, body = line, []
            elif line[:1] in (" ", "-") and not line.startswith("--- "):
                body.append(line)
    assert drop_additions("") == ""
