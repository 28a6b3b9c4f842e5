"""Harbor task folders read as Tasks (swectl/tasks/harbor.py), without building anything: the bundled terminal tasks,
a row's round trip, one clear problem per unusable folder (the others still load), the reward file's parse, the
Harbor patch policy, and the export's judge on pytest output."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import msgspec
import pytest

from swectl.errors import TaskDataError
from swectl.eval.harbor_export import JUDGE
from swectl.grading.patch_policy import review_harbor_patch
from swectl.tasks.harbor import HarborTaskError, harbor_meta, parse_reward, read_task
from swectl.tasks.sources import load_tasks, normalise_row

REPO = Path(__file__).resolve().parents[1]
BUNDLED_HARBOR = REPO / "swectl" / "data" / "bundled" / "harbor"


def test_bundled_harbor_tasks_load_with_their_settings() -> None:
    loaded = load_tasks(BUNDLED_HARBOR, strict=True)
    assert [t.instance_id for t in loaded.tasks] == ["csv-region-totals", "fix-make-build", "log-error-counts"]
    for task in loaded.tasks:
        meta = harbor_meta(task)
        assert task.source == "harbor" and task.log_parser == "harbor" and task.eval_type == "reward"
        assert meta.workdir == "/app" and meta.allow_internet is False and meta.has_solution
        assert task.image.startswith(f"localhost/swectl-harbor.{task.instance_id}:") and not task.patch
        assert task.problem_statement == (BUNDLED_HARBOR / task.instance_id / "instruction.md").read_text()
        assert "/tests/test.sh" in task.eval_script
    assert harbor_meta(loaded.tasks[1]).verifier_timeout_s == 180.0
    assert harbor_meta(loaded.tasks[1]).agent_timeout_s == 900.0
    # the same folder names the same image (its content), a changed environment another one
    assert read_task(BUNDLED_HARBOR / "fix-make-build").image == loaded.tasks[1].image


def test_the_verifier_script_carries_the_tests_folder_whole() -> None:
    task = read_task(BUNDLED_HARBOR / "log-error-counts")
    encoded = task.eval_script.split("<<'SWECTL_TESTS_END' || exit 91\n", 1)[1].split("\nSWECTL_TESTS_END", 1)[0]
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(encoded.replace("\n", "")))) as tar:
        names = tar.getnames()
        body = tar.extractfile("test.sh").read()
    assert "test.sh" in names and body == (BUNDLED_HARBOR / "log-error-counts" / "tests" / "test.sh").read_bytes()


def test_a_harbor_row_round_trips_and_a_stripped_one_is_refused() -> None:
    task = read_task(BUNDLED_HARBOR / "csv-region-totals")
    row = json.loads(msgspec.json.encode(task.row()))
    assert normalise_row(row, "row 1") == task
    with pytest.raises(TaskDataError, match=r"extra\.harbor"):  # a RowProblemError
        normalise_row({**row, "harbor": None} | {"eval_script": ""}, "row 2")


def _task(root: Path, name: str, *, toml: str = "", dockerfile: str = "FROM debian:bookworm-slim\nWORKDIR /app\n",
          test: bool = True, instruction: str = "do it") -> Path:
    folder = root / name
    (folder / "environment").mkdir(parents=True)
    (folder / "task.toml").write_text(toml)
    (folder / "instruction.md").write_text(instruction)
    (folder / "environment" / "Dockerfile").write_text(dockerfile)
    if test:
        (folder / "tests").mkdir()
        (folder / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    return folder


@pytest.mark.parametrize(("kind", "problem"), [
    ("steps", "multi-step"), ("compose", "docker-compose"), ("no_workdir", "no WORKDIR"),
    ("root_workdir", "other than /"),
    ("stages", "2 FROM stages"), ("no_test", "tests/test.sh: missing"), ("empty_instruction", "instruction.md: empty"),
    ("bad_toml", "not TOML"), ("gpus", "accelerators"), ("separate_verifier", "environment of its own"),
])
def test_each_unusable_folder_is_one_problem_naming_it(tmp_path: Path, kind: str, problem: str) -> None:
    _task(tmp_path, "good")
    kw: dict = {
        "steps": {"toml": "[[steps]]\nname = 'a'\n"},
        "compose": {},
        "no_workdir": {"dockerfile": "FROM debian:bookworm\n"},
        "root_workdir": {"dockerfile": "FROM debian:bookworm\nWORKDIR /\n"},
        "stages": {"dockerfile": "FROM debian:bookworm AS a\nFROM debian:bookworm\nWORKDIR /app\n"},
        "no_test": {"test": False},
        "empty_instruction": {"instruction": "  \n"},
        "bad_toml": {"toml": "[verifier\n"},
        "gpus": {"toml": "[environment]\ngpus = 1\n"},
        "separate_verifier": {"toml": "[verifier]\nenvironment_mode = 'separate'\n"},
    }[kind]
    bad = _task(tmp_path, "bad", **kw)
    if kind == "compose":
        (bad / "environment" / "docker-compose.yaml").write_text("services: {}\n")
    loaded = load_tasks(tmp_path)
    assert [t.instance_id for t in loaded.tasks] == ["good"]
    assert len(loaded.problems) == 1 and loaded.problems[0].location == str(bad)
    assert problem in loaded.problems[0].message, loaded.problems[0].message


def test_one_task_folder_alone_is_a_task_set(tmp_path: Path) -> None:
    shutil.copytree(BUNDLED_HARBOR / "log-error-counts", tmp_path / "log-error-counts")
    assert [t.instance_id for t in load_tasks(tmp_path / "log-error-counts").tasks] == ["log-error-counts"]


@pytest.mark.parametrize(("text", "name", "reward"), [
    ("1\n", "reward.txt", 1.0), (" 0.5 ", "reward.txt", 0.5), ('{"reward": 0.25, "other": 3}', "reward.json", 0.25),
    ('{"accuracy": 1}', "reward.json", 1.0), ("0", "reward.json", 0.0),
])
def test_reward_files_parse(text: str, name: str, reward: float) -> None:
    assert parse_reward(text, name) == reward


@pytest.mark.parametrize(("text", "name"), [("yes", "reward.txt"), ("", "reward.txt"), ('{"a": 1, "b": 2}',
                                                                                      "reward.json"),
                                            ("{", "reward.json"), ('{"reward": true}', "reward.json")])
def test_a_reward_file_without_a_reward_is_refused(text: str, name: str) -> None:
    with pytest.raises(HarborTaskError):
        parse_reward(text, name)


def _diff(path: str, body: str = "x", mode: str = "100644") -> str:
    return (f"diff --git a/{path} b/{path}\nnew file mode {mode}\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1 @@\n"
            f"+{body}\n")


def test_the_harbor_patch_policy_keeps_what_a_terminal_task_may_need() -> None:
    for path in ("Makefile", "tests/test_x.py", "build/tool.so", "src/conftest_helper.py", "json.py"):
        assert not review_harbor_patch(_diff(path)).is_tampered, path
    assert not review_harbor_patch(_diff("latest", "target", mode="120000")).is_tampered  # a symlink may be the task
    for path in ("conftest.py", "pytest.ini", ".gitattributes", "sitecustomize.py", "x.pth", ".git/config"):
        assert review_harbor_patch(_diff(path)).is_tampered, path
    assert review_harbor_patch(_diff("tool.py", "import os; os.environ['PYTEST_ADDOPTS'] = '-p x'")).is_tampered
    assert review_harbor_patch(_diff("pytest.py")).shadows  # shadows pytest unless the folder had it (git asks)
    assert review_harbor_patch("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n").is_tampered  # not a git diff


PYTEST_LOG = """>>>>> Start Test Output
tests/test_a.py::test_one PASSED
=========================== short test summary info ============================
PASSED tests/test_a.py::test_one
PASSED tests/test_a.py::test_two[x - y]
FAILED tests/test_a.py::test_three - AssertionError: boom
XFAIL tests/test_a.py::test_four
>>>>> End Test Output
"""


@pytest.mark.parametrize(("f2p", "p2p", "reward"), [
    (["tests/test_a.py::test_one"], ["tests/test_a.py::test_two[x - y]"], "1"),
    (["tests/test_a.py::test_four"], [], "1"),
    (["tests/test_a.py::test_three"], [], "0"),
    (["tests/test_a.py::test_one"], ["tests/test_a.py::test_missing"], "0"),
])
def test_the_exported_judge_applies_swe_benchs_rule(tmp_path: Path, f2p: list[str], p2p: list[str],
                                                    reward: str) -> None:
    (tmp_path / "judge.py").write_text(JUDGE)
    (tmp_path / "eval.log").write_text(PYTEST_LOG)
    (tmp_path / "tests.json").write_text(json.dumps({"FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p}))
    out = subprocess.run([sys.executable, "-S", str(tmp_path / "judge.py"), str(tmp_path / "eval.log"),
                          str(tmp_path / "tests.json")], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == reward, out.stderr


def test_a_harbor_tasks_agent_timeout_bounds_its_episode() -> None:
    from swectl.actors.rollout import episode_config_for
    from swectl.agent.loop import EpisodeConfig
    from swectl.agent.protocol import AgentLimits

    task = read_task(BUNDLED_HARBOR / "fix-make-build")  # [agent] timeout_sec = 900
    assert episode_config_for(task, EpisodeConfig()).limits.wall_time_s == 900.0
    short = EpisodeConfig(limits=AgentLimits(wall_time_s=60.0))
    assert episode_config_for(task, short) is short  # the shorter bound wins
    other = msgspec.structs.replace(task, source="swe-bench")
    assert episode_config_for(other, EpisodeConfig()).limits.wall_time_s == 1800.0
