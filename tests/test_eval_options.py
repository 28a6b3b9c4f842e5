"""`swectl eval` without sandboxes: the [rollout] section and its shorthand flags, task selection, predictions
files, run settings on resume, waiting for endpoints (real sockets), and the one-line errors of bad usage."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import msgspec
import pytest

from swectl.cli.eval import parse_slice, rollout_overrides, select_tasks
from swectl.cli.main import build_parser, main
from swectl.config import RolloutOptions, load_config
from swectl.engine.client import OpenAIChatClient, SglangClient
from swectl.errors import ConfigError, EngineConnectError, EngineUnavailableError, TaskDataError
from swectl.eval.agents import AgentSummary, RunSettings, prepare_run_dir, wait_endpoint
from swectl.eval.patches import PatchReport, load_predictions
from swectl.eval.report import RunReport
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.sources import load_tasks

ROOT = Path(__file__).resolve().parents[1]


def eval_args(*argv: str):
    return build_parser().parse_args(["eval", *argv])


# ------------------------------------------------------------------ [rollout]


def test_rollout_defaults_are_the_old_flag_defaults() -> None:
    assert load_config(None).rollout == RolloutOptions(samples=1, step_limit=30, max_tokens=512, context=8192,
                                                       temperature=0.0, manage_context=False)
    assert load_config(ROOT / "examples" / "local.toml").rollout == RolloutOptions()


def test_flags_are_shorthands_that_win_over_set() -> None:
    args = eval_args("--gold", "--set", "rollout.step_limit=7", "--set", "rollout.temperature=0.3",
                     "--temperature", "0.9", "--manage-context")
    config = load_config(None, [*args.overrides, *rollout_overrides(args)])
    assert config.rollout.step_limit == 7 and config.rollout.temperature == 0.9 and config.rollout.manage_context
    assert rollout_overrides(eval_args("--gold")) == []  # no flag: the section decides


def test_rollout_section_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.step_limit"):
        load_config(None, ["rollout.step_limit=0"])
    with pytest.raises(ConfigError, match="unknown field `stepp`"):
        load_config(None, ["rollout.stepp=3"])
    with pytest.raises(ConfigError, match=r"rollout\.max_tokens \(9000\) must be below rollout\.context"):
        load_config(None, ["rollout.max_tokens=9000"])


def test_check_config_shows_the_rollout_section() -> None:
    done = subprocess.run([sys.executable, "-m", "swectl.cli.main", "check-config", "--set", "rollout.samples=3"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rollout"] == {"samples": 3, "step_limit": 30, "max_tokens": 512, "context": 8192,
                                                  "max_format_errors": 3, "temperature": 0.0,
                                                  "manage_context": False, "seed": None, "reuse_grades": True,
                                                  "agent_config": ""}


# ------------------------------------------------------------------ selection


def test_slices_read_as_in_python() -> None:
    tasks = load_tasks(BUNDLED_TASKS).tasks
    assert select_tasks(tasks, [], "-1:") == tasks[-1:]
    assert select_tasks(tasks, [], "0:6:2") == tasks[0:6:2]
    assert select_tasks(tasks, [], ":3") == tasks[:3]
    assert eval_args("--gold", "--slice", "-2:").slice == "-2:"  # a value, not an unknown option
    for bad in ("abc", "1", "0:2:0", "1:2:3:4", "a:b"):
        with pytest.raises(ConfigError, match="--slice"):
            parse_slice(bad)
    with pytest.raises(ConfigError, match="selects none of the 36 tasks"):
        select_tasks(tasks, [], "5:2")
    with pytest.raises(ConfigError, match="unknown instance ids: nope"):
        select_tasks(tasks, ["nope"], "")


# ------------------------------------------------------------------ predictions files


def test_malformed_prediction_names_its_real_line(tmp_path: Path) -> None:
    path = tmp_path / "preds.jsonl"
    path.write_text('{"instance_id": "a", "model_patch": ""}\n\n{"instance_id": "b", "model_patch": x}\n')
    with pytest.raises(TaskDataError, match=r"preds\.jsonl:3: not valid JSON"):
        load_predictions(path)
    path = tmp_path / "preds.json"
    path.write_text('[\n {"instance_id": "a"},\n oops\n]')
    with pytest.raises(TaskDataError, match=r"preds\.json:3: not valid JSON"):
        load_predictions(path)
    path.write_bytes(b"\xff\xfe binary")
    with pytest.raises(TaskDataError, match="not UTF-8"):
        load_predictions(path)


# ------------------------------------------------------------------ reports


def test_both_reports_share_the_run_report_fields() -> None:
    shared = set(RunReport.__struct_fields__)
    assert shared <= set(PatchReport.__struct_fields__) and shared <= set(AgentSummary.__struct_fields__)
    assert {"total", "resolved", "infra_errors", "resolve_rate", "mode", "model", "format_version"} <= shared


# ------------------------------------------------------------------ resuming


def settings(**rollout: object) -> RunSettings:
    return RunSettings(mode="model", model="/m", tokenizer="/m", model_name="/m",
                       rollout=msgspec.structs.replace(RolloutOptions(), **rollout))


def test_resume_only_with_the_recorded_settings(tmp_path: Path) -> None:
    prepare_run_dir(tmp_path, settings())
    prepare_run_dir(tmp_path, settings(temperature=0.7))  # nothing finished yet: nothing to mix
    (tmp_path / "results.jsonl").write_text('{"instance_id": "x", "sample": 0, "exit_status": "Submitted", '
                                            f'"outcome": "COMPLETED", "artifacts": "{tmp_path / "x__0"}"}}\n')
    (tmp_path / "x__0").mkdir()
    prepare_run_dir(tmp_path, settings(temperature=0.7))  # same settings: resumes
    with pytest.raises(ConfigError, match=r"rollout\.temperature: 0\.7 -> 0\.0.*--fresh") as err:
        prepare_run_dir(tmp_path, settings())
    assert "step_limit" not in str(err.value)  # only what differs
    prepare_run_dir(tmp_path, settings(), fresh=True)
    assert not (tmp_path / "results.jsonl").exists() and not (tmp_path / "x__0").exists()
    assert msgspec.json.decode((tmp_path / "run.json").read_bytes(), type=RunSettings) == settings()


def test_results_without_recorded_settings_are_not_resumed(tmp_path: Path) -> None:
    (tmp_path / "results.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"no run\.json"):
        prepare_run_dir(tmp_path, settings())


# ------------------------------------------------------------------ waiting for endpoints


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (not HTTP)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for s in accepted:
        s.close()
    server.close()


@pytest.fixture
def http_port() -> Iterator[int]:
    """A real HTTP server answering 200 to /health and 404 to everything else."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_refused_connection_fails_at_once() -> None:
    async def go() -> None:
        async with SglangClient(f"http://127.0.0.1:{free_port()}") as client:
            await wait_endpoint(client, "/health", timeout_s=600, status=said.append)

    said: list[str] = []
    started = time.monotonic()
    with pytest.raises(EngineConnectError, match="Connection refused"):
        anyio.run(go)
    assert time.monotonic() - started < 5 and said == []


def test_a_server_that_does_not_answer_is_waited_for_out_loud(silent_port: int) -> None:
    async def go() -> None:
        async with OpenAIChatClient(f"http://127.0.0.1:{silent_port}/v1", "m") as client:
            await wait_endpoint(client, "/models", timeout_s=2.0, status=said.append)

    said: list[str] = []
    with pytest.raises(EngineUnavailableError, match=r"not ready after 2 s \(engine.start_timeout_s\)"):
        anyio.run(go)
    assert said and "waiting for" in said[0] and "GET /models" in said[0]


def test_any_http_answer_is_ready(http_port: int) -> None:
    async def go() -> None:
        async with SglangClient(f"http://127.0.0.1:{http_port}") as sglang:
            await wait_endpoint(sglang, "/health", timeout_s=5, status=said.append)
        async with OpenAIChatClient(f"http://127.0.0.1:{http_port}", "m") as chat:  # 404 /v1/models: speaks HTTP
            await wait_endpoint(chat, "/v1/models", timeout_s=5, status=said.append)

    said: list[str] = []
    anyio.run(go)
    assert said == []


# ------------------------------------------------------------------ usage errors: one line, exit 2


@pytest.mark.parametrize("argv, words", [
    (["--endpoint", "http://127.0.0.1:9"], "--endpoint needs --tokenizer"),
    (["--openai-url", "http://127.0.0.1:9"], "--openai-url needs --openai-model"),
    (["--gold", "--slice", "abc"], "--slice 'abc'"),
    (["--gold", "--slice", "5:2"], "selects none"),
    (["--gold", "--out", "/proc/swectl-test"], "--out /proc/swectl-test: cannot write there"),
    (["--model", "{tmp}"], "not a model folder (no config.json)"),
    (["--model", "{tmp}/missing"], "no such folder"),
    (["--gold", "--tasks", "{tmp}/empty.jsonl"], "no task rows in it"),
    (["--gold", "--tasks", "{tmp}/binary.jsonl"], "is a usable task"),
    (["--predictions", "{tmp}/unknown.jsonl"], "forget --tasks"),
])
def test_usage_errors_are_one_line_and_exit_2(argv: list[str], words: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "binary.jsonl").write_bytes(bytes(range(256)))
    (tmp_path / "unknown.jsonl").write_text('{"instance_id": "nope__nope-1", "model_patch": ""}\n')
    out = tmp_path / "out"
    if "--out" not in argv:
        argv = [*argv, "--out", str(out)]
    assert main(["eval", *(a.replace("{tmp}", str(tmp_path)) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not out.exists()  # refused before anything was written


def test_refused_endpoint_is_one_line_exit_3(tmp_path: Path) -> None:
    """A real `swectl eval --endpoint` process against a port nobody listens on."""
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")  # never loaded: the endpoint check comes first
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "swectl.cli.main", "eval", "--endpoint",
                           f"http://127.0.0.1:{free_port()}", "--tokenizer", str(tokenizer), "--slice", "0:1",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 3, done.stderr
    assert "Connection refused" in done.stderr and "Traceback" not in done.stderr
    assert time.monotonic() - started < 60
