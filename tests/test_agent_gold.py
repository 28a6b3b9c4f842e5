"""Gold replies (swectl/agent/gold.py) and the scripted engine (swectl/agent/scripted.py).

Every bundled task's gold replies parse as protocol turns, and their edit command, run for real (GNU sed,
python3) on a pre-image made from the patch's hunks, gives the post-image. The edge cases (escaping, inserts,
deletes, several hunks and files, new and deleted files, no newline at the end) go through the same check.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import anyio
import msgspec
import pytest

from swectl.agent.gold import (
    SUBMIT_COMMAND,
    GoldScriptError,
    attack_replies,
    give_up_replies,
    gold_replies,
    malformed_copy,
    parse_patch,
    recover_replies,
)
from swectl.agent.loop import Engine
from swectl.agent.protocol import SUBMIT_SENTINEL, FormatError, parse_action
from swectl.agent.scripted import ScriptedEngine, end_of_turn_id
from swectl.engine.wire import GenerateRequest, SamplingParams
from swectl.grading.patch_policy import review_patch
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.record import Task
from swectl.tasks.sources import load_tasks

BUNDLED = load_tasks(BUNDLED_TASKS).tasks
needs_tools = pytest.mark.skipif(not (shutil.which("sed") and shutil.which("python3") and shutil.which("bash")),
                                 reason="needs bash, GNU sed and python3")


def _images(patch: str) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """Pre- and post-image files built from the hunks alone: lines outside the hunks are distinct fillers, so
    line numbers match the real file's and a wrong line number or a non-unique match shows."""
    pre: dict[str, str | None] = {}
    post: dict[str, str | None] = {}
    for f in parse_patch(patch):
        if f.kind == "create":
            pre[f.path] = None
            h = f.hunks[0]
            post[f.path] = "".join(line + "\n" for line in h.new)[: -1 if h.new_open else None]
            continue
        old_lines: list[str] = []
        new_lines: list[str] = []
        filler = 0
        for h in f.hunks:
            while len(old_lines) < h.old_start - 1:
                filler += 1
                old_lines.append(f"# filler {filler}")
                new_lines.append(f"# filler {filler}")
            old_lines += h.old
            new_lines += h.new
        tail = [] if f.hunks[-1].old_open else [f"# filler end {n}" for n in range(3)]
        pre[f.path] = "\n".join(old_lines + tail) + ("" if f.hunks[-1].old_open else "\n")
        post[f.path] = None if f.kind == "delete" else "\n".join(new_lines + tail) + (
            "" if f.hunks[-1].new_open else "\n")
    return pre, post


def _run_edit(replies: list[str], patch: str, tmp_path: Path) -> None:
    """Write the pre-image, run the reply's edit command in it, compare with the post-image."""
    pre, post = _images(patch)
    for path, text in pre.items():
        if text is not None:
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_bytes(text.encode())
    look, edit = parse_action(replies[0]), parse_action(replies[1])
    for command in (look, edit):
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                              check=False)
        assert done.returncode == 0, f"{command!r} failed: {done.stderr}"
    for path, text in post.items():
        if text is None:
            assert not (tmp_path / path).exists(), f"{path} should be deleted"
        else:
            assert (tmp_path / path).read_bytes().decode() == text, f"{path}: the edit did not give the post-image"


def _task(patch: str, **fields: object) -> Task:
    fields = {"FAIL_TO_PASS": ["tests/test_x.py::test_it"], **fields}
    return Task(instance_id="demo__demo-1", repo="demo/demo", problem_statement="it breaks", patch=patch,
                **fields)  # type: ignore[arg-type]


def _modify(path: str, start: int, old: list[str], new: list[str], context: tuple[list[str], list[str]] = ([], [])
            ) -> str:
    before, after = context
    body = [f" {line}" for line in before] + [f"-{line}" for line in old] + [f"+{line}" for line in new] + [
        f" {line}" for line in after]
    n_old = len(before) + len(old) + len(after)
    n_new = len(before) + len(new) + len(after)
    return (f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -{start},{n_old} +{start},{n_new} @@\n"
            + "\n".join(body) + "\n")


# ---------------------------------------------------------------------------------------------- bundled tasks


def test_the_bundled_set_is_there() -> None:
    assert len(BUNDLED) == 36


@pytest.mark.parametrize("task", BUNDLED, ids=lambda t: t.instance_id)
def test_bundled_gold_replies_are_protocol_turns(task: Task) -> None:
    replies = gold_replies(task)
    assert 3 <= len(replies) <= 4
    actions = [parse_action(r) for r in replies]  # exactly one bash block each, or FormatError
    assert all(r.startswith("THOUGHT: ") for r in replies)
    assert actions[-1] == SUBMIT_COMMAND and SUBMIT_SENTINEL in actions[-1]
    assert actions[0].startswith("nl -ba ")
    assert actions[1].startswith("sed -i '")  # every bundled patch is one line: a sed one-liner
    assert "\n" not in actions[1] and len(actions[1]) < 160
    if len(replies) == 4:
        assert "python -m pytest" in actions[2] and task.FAIL_TO_PASS[0] in actions[2]


@pytest.mark.parametrize("task", BUNDLED[:3], ids=lambda t: t.instance_id)
def test_give_up_replies_share_the_gold_look_then_submit(task: Task) -> None:
    gold, give_up = gold_replies(task), give_up_replies(task)
    assert len(give_up) == 2 and give_up[0] == gold[0]
    assert parse_action(give_up[1]) == SUBMIT_COMMAND and "without a change" in give_up[1]
    with pytest.raises(GoldScriptError, match="demo__demo-1: the task has no gold patch"):
        give_up_replies(_task(""))


@needs_tools
def test_the_attack_teacher_writes_the_pytest_ini_plugin_attack_and_the_policy_calls_it_tampered(
        tmp_path: Path) -> None:
    """The reward-hacking teacher (benchmarks/hack.py) acts out the issue's attack: its commands, run in a git
    repository, leave a root pytest.ini that loads hackplugin, a plugin whose hook turns failed reports into
    passes; the patch it submits is one the patch policy calls tampered."""
    task = BUNDLED[0]
    look, attack, submit = attack_replies(task)
    assert look == gold_replies(task)[0] and parse_action(submit) == SUBMIT_COMMAND
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["bash", "-c", parse_action(attack)], cwd=tmp_path, check=True)
    assert (tmp_path / "pytest.ini").read_text() == "[pytest]\naddopts = -p hackplugin\n"
    plugin = (tmp_path / "hackplugin.py").read_text()
    assert "hookwrapper=True" in plugin and 'report.outcome = "passed"' in plugin
    compile(plugin, "hackplugin.py", "exec")
    subprocess.run(["git", "add", "-A"], cwd=tmp_path, check=True)
    patch = subprocess.run(["git", "diff", "--cached"], cwd=tmp_path, check=True, capture_output=True,
                           text=True).stdout
    verdict = review_patch(patch)
    assert verdict.tampered and any("pytest.ini" in why for why in verdict.tampered)


@pytest.mark.parametrize("task", BUNDLED, ids=lambda t: t.instance_id)
def test_recover_replies_put_a_malformed_copy_before_the_look_and_the_edit(task: Task) -> None:
    gold, recover = gold_replies(task), recover_replies(task)
    assert len(recover) == len(gold) + 2
    slip_look, look, slip_edit, edit, *rest = recover
    assert [look, edit, *rest] == gold
    for slip, right in ((slip_look, look), (slip_edit, edit)):
        assert right.startswith(slip) and len(slip) < len(right)
        with pytest.raises(FormatError):
            parse_action(slip)
    assert recover_replies(task) == recover  # the cut points are stable


def test_a_malformed_copy_is_cut_before_the_closing_fence() -> None:
    reply = "THOUGHT: x\n\n```bash\nls\n```"
    copy = malformed_copy(reply, "seed")
    assert reply.startswith(copy) and len(copy) < len(reply)
    with pytest.raises(FormatError):
        parse_action(copy)


@needs_tools
@pytest.mark.parametrize("task", BUNDLED, ids=lambda t: t.instance_id)
def test_bundled_gold_edit_turns_the_pre_image_into_the_post_image(task: Task, tmp_path: Path) -> None:
    _run_edit(gold_replies(task), task.patch, tmp_path)


def test_the_test_command_takes_the_eval_scripts_environment() -> None:
    task = next(t for t in BUNDLED if t.instance_id.startswith("cachetools"))
    test = parse_action(gold_replies(task)[2])
    assert test.startswith("PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=src python -m pytest -qq -p no:cacheprovider ")
    assert test.split()[-3:] == task.FAIL_TO_PASS[:3]


def test_without_an_eval_script_or_pytest_ids_there_is_no_test_turn() -> None:
    patch = _modify("a.py", 3, ["x = 1"], ["x = 2"])
    assert len(gold_replies(_task(patch))) == 3
    assert len(gold_replies(_task(patch, FAIL_TO_PASS=["test_it (tests.TestX)"], eval_script="pytest"))) == 3


# ---------------------------------------------------------------------------------------------- edge cases


@needs_tools
@pytest.mark.parametrize(("old", "new"), [
    ("    return a/b  # halve", "    return a*b  # halve"),
    ("    s = 'it''s' & \"x\" \\n [0-9]* ^$ .", "    s = 'its' & \"y\" \\n [0-9]* ^$ ."),
    ("^start = 1$", "^start = 2$"),
    ("    x = y if y else z", "    x = z if y else y"),
    ("\tif a == b:", "\tif a != b:"),
    ("    return is_this(x)", "    return not is_this(x)"),
    ("    url = 'http://a/b|c#d,e:f@g%h!i'", "    url = 'http://a/b|c#d,e:f@g%h!j'"),
    ("    return value", "        return value"),
    ("    pass", "    pass  # ok"),
], ids=["slash", "quotes-and-regex", "anchors", "repeated-word", "tab", "insert-word", "no-free-delimiter",
        "indent", "append-comment"])
def test_one_line_changes_round_trip(old: str, new: str, tmp_path: Path) -> None:
    patch = _modify("pkg/mod.py", 10, [old], [new], (["def f(a, b):", "    y = a"], ["", "def g():"]))
    replies = gold_replies(_task(patch))
    _run_edit(replies, patch, tmp_path)


@needs_tools
def test_an_inserted_line_keeps_its_indentation_and_backslashes(tmp_path: Path) -> None:
    line = "        path = 'C:\\\\dir\\\\'  # it's"
    patch = _modify("m.py", 5, [], [line], (["def f():", "    if x:"], ["    return"]))
    replies = gold_replies(_task(patch))
    assert "i\\" in parse_action(replies[1])
    _run_edit(replies, patch, tmp_path)


@needs_tools
def test_a_line_added_after_the_last_context_line(tmp_path: Path) -> None:
    patch = _modify("m.py", 5, [], ["    return x"], (["def f(x):", "    x += 1"], []))
    replies = gold_replies(_task(patch))
    assert "a\\" in parse_action(replies[1])
    _run_edit(replies, patch, tmp_path)


@needs_tools
def test_a_deleted_line(tmp_path: Path) -> None:
    patch = _modify("m.py", 5, ["    x = None"], [], (["def f(x):"], ["    return x"]))
    replies = gold_replies(_task(patch))
    assert parse_action(replies[1]) == "sed -i '6d' m.py"
    _run_edit(replies, patch, tmp_path)


@needs_tools
def test_multi_line_hunks_fall_back_to_a_python_edit(tmp_path: Path) -> None:
    patch = _modify("m.py", 20, ["    a = 1", "    b = 2"], ["    a = 2", "    b = 1", "    c = '''EOF'''"],
                    (["def f():"], ["    return a"]))
    patch += _modify("other/n.py", 3, ["x = 'é'"], ["x = 'è'"])
    replies = gold_replies(_task(patch))
    edit = parse_action(replies[1])
    assert edit.startswith("python3 - <<'EOF'\n") and edit.endswith("\nEOF")
    assert "== m.py ==" in parse_action(replies[0])
    _run_edit(replies, patch, tmp_path)


@needs_tools
def test_two_hunks_in_one_file(tmp_path: Path) -> None:
    first = _modify("m.py", 4, ["x = 1"], ["x = 2"], (["a"], ["b"]))
    second = _modify("m.py", 40, ["y = 1"], ["y = 2"], (["c"], ["d"]))
    patch = first + second.split("\n", 3)[3]  # one file header, two hunks
    replies = gold_replies(_task(patch))
    assert parse_action(replies[1]).count("edit(") == 3  # the definition and two calls
    _run_edit(replies, patch, tmp_path)


@needs_tools
def test_new_and_deleted_files(tmp_path: Path) -> None:
    patch = ("diff --git a/pkg/new.py b/pkg/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/pkg/new.py\n"
             "@@ -0,0 +1,2 @@\n+def f():\n+    return 1\n"
             "diff --git a/old.py b/old.py\ndeleted file mode 100644\n--- a/old.py\n+++ /dev/null\n"
             "@@ -1,1 +0,0 @@\n-x = 1\n")
    (tmp_path / "pkg").mkdir()
    replies = gold_replies(_task(patch))
    _run_edit(replies, patch, tmp_path)


@needs_tools
def test_no_newline_at_the_end(tmp_path: Path) -> None:
    patch = ("diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n x = 1\n-y = 1\n"
             "\\ No newline at end of file\n+y = 2\n\\ No newline at end of file\n")
    replies = gold_replies(_task(patch))
    assert parse_action(replies[1]).startswith("python3 ")
    _run_edit(replies, patch, tmp_path)


@pytest.mark.parametrize(("patch", "why"), [
    ("", "no gold patch"),
    ("diff --git a/a.png b/a.png\nBinary files a/a.png and b/a.png differ\n", "binary"),
    ("diff --git a/a.py b/b.py\nsimilarity index 90%\nrename from a.py\nrename to b.py\n", "renames"),
    ("diff --git a/a.sh b/a.sh\nold mode 100644\nnew mode 100755\n", "mode"),
    ("diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1,3 +1,3 @@\n-x\n+y\n", "cut short"),
    ("just some text\n", "changes no file"),
    ('--- "a/we\\tird.py"\n+++ "b/we\\tird.py"\n@@ -1 +1 @@\n-x\n+y\n', "quoted path"),
])
def test_inexpressible_patches_say_why(patch: str, why: str) -> None:
    with pytest.raises(GoldScriptError, match=why) as caught:
        gold_replies(_task(patch))
    assert str(caught.value).startswith("demo__demo-1: ")


# ---------------------------------------------------------------------------------------------- the engine


def _generate(engine: ScriptedEngine, step: int, max_new_tokens: int = 4096):
    request = GenerateRequest(input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=max_new_tokens),
                              rid=f"demo#0/{step}")
    return anyio.run(engine.generate, request)


def test_scripted_engine_emits_each_reply_then_the_end_of_turn_token(tiny_tokenizer) -> None:
    replies = gold_replies(BUNDLED[0])
    engine = ScriptedEngine(replies, tiny_tokenizer)
    assert isinstance(engine, Engine)
    eot = end_of_turn_id(tiny_tokenizer)
    assert tiny_tokenizer.convert_ids_to_tokens(eot) == "<|im_end|>"
    for n, reply in enumerate(replies):
        result = _generate(engine, n)
        assert result.finish_reason == "stop" and result.weight_version == "gold"
        assert result.output_ids[-1] == eot
        assert tiny_tokenizer.decode(result.output_ids[:-1]) == reply
        assert result.output_logprobs == [0.0] * len(result.output_ids)
        assert result.completion_tokens == len(result.output_ids)


def test_scripted_engine_cuts_at_max_tokens_and_aborts_past_the_script(tiny_tokenizer) -> None:
    engine = ScriptedEngine(["THOUGHT: x\n\n```bash\nls\n```"], tiny_tokenizer)
    cut = _generate(engine, 0, max_new_tokens=3)
    assert cut.finish_reason == "length" and len(cut.output_ids) == 3
    past = _generate(engine, 1)
    assert past.finish_reason == "abort" and "the script has 1 replies" in (past.finish_message or "")
    assert msgspec.json.encode(past)  # a plain wire struct


def test_a_reply_longer_than_a_turn_may_be_is_refused_before_any_sandbox(tiny_tokenizer) -> None:
    from swectl.eval.gold import _fitting

    replies = gold_replies(BUNDLED[0])
    assert _fitting(replies, tiny_tokenizer, 4096) == replies
    with pytest.raises(GoldScriptError, match=r"reply 1 is \d+ tokens, more than rollout.max_tokens \(16\)"):
        _fitting(replies, tiny_tokenizer, 16)
