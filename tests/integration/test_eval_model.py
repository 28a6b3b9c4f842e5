"""`swectl eval --model`: the tiny policy (`swectl model init`) on the CPU engine, real sandboxes and the
grader, with every artifact; a rerun resumes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the cpu extra (pip install 'swectl[cpu]')")
pytest.importorskip("uvicorn", reason="needs the cpu extra (pip install 'swectl[cpu]')")

from swectl.agent.protocol import AgentLimits, AgentTemplates, Renderer
from swectl.cli.main import main
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.record import TESTBED
from swectl.tasks.sources import load_tasks
from swectl.testing.replay import gold_replies

from .conftest import STARTED_MARK

pytestmark = [pytest.mark.integration]


def test_eval_with_the_tiny_model(model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["eval", "--model", str(model), "--slice", "0:2", "--step-limit", "2", "--max-tokens", "24",
            "--concurrency", "2", "--out", str(tmp_path)]
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["finished"] == summary["total"] == 2
    assert summary["infra_errors"] == 0
    assert summary["mode"] == "model" and summary["settings"]["rollout"]["step_limit"] == 2
    assert sum(summary["exit_status"].values()) == 2
    assert "agent/turns_mean" in summary["metrics"]
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    preds = [json.loads(line) for line in (tmp_path / "preds.jsonl").read_text().splitlines()]
    assert {r["instance_id"] for r in results} == {p["instance_id"] for p in preds}
    for r in results:
        d = Path(r["artifacts"])
        ep = json.loads((d / "traj.json").read_text())["episode"]
        t = ep["trajectory"]
        assert len(t["token_ids"]) == len(t["loss_mask"]) == len(t["logprobs"])
        # Every engine token is in the trajectory with its logprob (mask 1), and nothing else is.
        assert sum(t["loss_mask"]) == sum(s["output_tokens"] for s in ep["steps"]) > 0
        assert all(lp <= 0.0 for lp, m in zip(t["logprobs"], t["loss_mask"], strict=True) if m)
        assert all(lp == 0.0 for lp, m in zip(t["logprobs"], t["loss_mask"], strict=True) if not m)
        assert (d / "patch.diff").exists()
        assert json.loads((d / "meta.json").read_text())["exit_status"]
    # A rerun with one more task only runs that task.
    assert main([*args[:4], "0:3", *args[5:]]) == 0
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3
    # A rerun with other settings is refused, naming the difference (--set and the flag are the same knob).
    for other in (["--temperature", "0.5"], ["--set", "rollout.temperature=0.5"]):
        assert main([*args, *other]) == 2
        err = capsys.readouterr().err
        assert "rollout.temperature: 0.0 -> 0.5" in err and "--fresh" in err
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3


def _episode_tokens(out: Path) -> dict[tuple[str, int], list[int]]:
    """Every episode's token stream of an evaluation folder, by (instance, sample)."""
    tokens = {}
    for line in (out / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        ep = json.loads((Path(r["artifacts"]) / "traj.json").read_text())["episode"]
        tokens[(r["instance_id"], r["sample"])] = ep["trajectory"]["token_ids"]
    return tokens


def test_seeded_evaluations_repeat(model: Path, tmp_path: Path) -> None:
    """--seed: at temperature 1, two evaluations with one seed sample the same tokens in every episode (though the
    engine batches them differently); another seed, or another sample of the same task, samples others."""
    base = ["eval", "--model", str(model), "--slice", "0:2", "--samples", "2", "--step-limit", "2", "--max-tokens",
            "16", "--temperature", "1.0", "--concurrency", "2"]
    runs = {}
    for name, seed, concurrency in (("a", "7", "2"), ("b", "7", "1"), ("c", "8", "2")):
        assert main([*base[:-1], concurrency, "--seed", seed, "--out", str(tmp_path / name)]) == 0
        runs[name] = _episode_tokens(tmp_path / name)
    assert len(runs["a"]) == 4 and runs["a"].keys() == runs["b"].keys() == runs["c"].keys()
    assert runs["a"] == runs["b"]
    assert all(runs["a"][k] != runs["c"][k] for k in runs["a"])
    for instance in {k[0] for k in runs["a"]}:
        assert runs["a"][(instance, 0)] != runs["a"][(instance, 1)]
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["settings"]["rollout"]["seed"] == 7


def test_eval_with_the_tiny_model_on_namespace_sandboxes(model: Path, tmp_path: Path) -> None:
    args = ["eval", "--model", str(model), "--slice", "0:2", "--step-limit", "2", "--max-tokens", "24",
            "--concurrency", "2", "--set", 'sandbox.backend="namespace"', "--out", str(tmp_path)]
    assert main(args) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["finished"] == summary["total"] == 2
    assert summary["infra_errors"] == 0
    assert ": namespace sandboxes on 1 node(s)" in (tmp_path / "swectl.log").read_text()


@contextlib.contextmanager
def replay_server(model: Path, replies: dict[str, list[str]], tmp_path: Path) -> Iterator[str]:
    """remote/programs/replay_server.py answering with ``replies`` per instance; yields its URL."""
    path = tmp_path / "replies.json"
    path.write_text(json.dumps(replies))
    server = subprocess.Popen([sys.executable, "-m", "swectl.remote.programs.replay_server", "--replies", str(path),
                               "--tokenizer", str(model), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert line.startswith("ready on "), line
        yield line.split()[-1]
    finally:
        server.terminate()
        server.wait(10)


def test_replayed_gold_resolves_everything_through_http(model: Path, tmp_path: Path) -> None:
    """The whole path: `swectl eval --endpoint` -> engine client (HTTP, SGLang API) -> replay server ->
    agent loop -> real sandboxes -> grader. Every bundled task must resolve."""
    tasks = load_tasks(BUNDLED_TASKS, strict=True).tasks
    out = tmp_path / "run"
    with replay_server(model, {t.instance_id: gold_replies(t.patch) for t in tasks}, tmp_path) as url:
        assert main(["eval", "--endpoint", url, "--tokenizer", str(model), "--concurrency", "4", "--step-limit", "5",
                     "--max-tokens", "4096", "--context", "16384", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total"] == len(tasks), summary
    assert summary["resolved"] == len(tasks), summary
    assert summary["resolve_rate"] == 1.0
    assert summary["exit_status"] == {"Submitted": len(tasks)}
    preds = [json.loads(line) for line in (out / "preds.jsonl").read_text().splitlines()]
    assert len(preds) == len(tasks)
    assert all(p["model_patch"].startswith("diff --git") for p in preds)


def test_managed_context_over_http_with_real_sandboxes(model: Path, tmp_path: Path) -> None:
    """Episodes that outgrow --context with --manage-context: every step's prompt fits the budget, later steps
    omit middle turns (the marker is in what the engine saw), each step is a sample, and the fix applied at
    the end still resolves."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    tasks = load_tasks(BUNDLED_TASKS, strict=True).tasks[:2]
    explore = "THOUGHT: looking around first.\n\n```bash\nls -la /usr/lib/python3*/ | head -30\n```"
    replies = {t.instance_id: [explore] * 8 + gold_replies(t.patch) for t in tasks}
    renderer = Renderer(AgentTemplates(), AgentLimits())

    def prompt_tokens(task) -> int:  # type: ignore[no-untyped-def]
        conv = [{"role": "system", "content": renderer.system()},
                {"role": "user", "content": renderer.instance(task.problem_statement, TESTBED)}]
        return len(tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)["input_ids"])

    max_new = max(len(tok.encode(r, add_special_tokens=False)) for rs in replies.values() for r in rs) + 16
    budget = max(prompt_tokens(t) for t in tasks) + max_new + 3000  # room for a few turns, not for 8
    out = tmp_path / "run"
    with replay_server(model, replies, tmp_path) as url:
        assert main(["eval", "--endpoint", url, "--tokenizer", str(model), "--step-limit", "12", "--concurrency", "2",
                     "--max-tokens", str(max_new), "--context", str(budget), "--manage-context",
                     "--instances", *replies, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resolved"] == 2, summary
    assert summary["exit_status"] == {"Submitted": 2}, summary
    for r in (json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()):
        ep = json.loads((Path(r["artifacts"]) / "traj.json").read_text())["episode"]
        samples = ep["samples"]
        assert len(samples) == len(ep["steps"]) == 10
        assert all(len(s["prompt_ids"]) + max_new <= budget for s in samples)
        assert len(ep["trajectory"]["token_ids"]) > budget  # the whole conversation did not fit
        assert samples[0]["omitted_turns"] == 0
        assert samples[-1]["omitted_turns"] > 0
        assert "omitted to fit the context window" in tok.decode(samples[-1]["prompt_ids"])
        # Each sample's output is exactly what the trajectory recorded for that turn.
        emitted = [t for t, m in zip(ep["trajectory"]["token_ids"], ep["trajectory"]["loss_mask"], strict=True) if m]
        assert [t for s in samples for t in s["output_ids"]] == emitted


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupt_leaves_no_containers(sig: str, model: Path, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) or `kill` (SIGTERM: Slurm, systemd, Kubernetes) while episodes run: the command exits 130,
    says so truthfully, and every container it started is gone. The child gets SIGINT's default disposition
    (a suite run from a background job would hand it down ignored)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from swectl.images.project import BUNDLED_TASKS
    from swectl.remote.nodes.podman import run_local_podman
    from swectl.tasks.sources import load_tasks

    tasks = load_tasks(BUNDLED_TASKS, strict=True).tasks[:4]
    slow = [f"THOUGHT: wait\n```bash\ntouch {STARTED_MARK}; sleep 20\n```"] * 5
    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps({t.instance_id: slow for t in tasks}))
    server = subprocess.Popen([sys.executable, "-m", "swectl.remote.programs.replay_server", "--replies", str(replies),
                               "--tokenizer", str(model), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split()[-1]
        run = subprocess.Popen([sys.executable, "-m", "swectl.cli.main", "eval", "--endpoint", url, "--tokenizer",
                                str(model), "--instances", *[t.instance_id for t in tasks], "--concurrency", "4",
                                "--set", "sandbox.backend='podman'", "--out", str(tmp_path / "run")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        label = f"label=swectl.controller={socket.gethostname()}:{run.pid}"

        def containers() -> list[str]:
            return run_local_podman("ps", "-a", "-q", "--filter", label).stdout.decode().split()

        def running(container: str) -> bool:  # its episode's first command has started
            return run_local_podman("exec", container, "test", "-e", STARTED_MARK, check=False).exit_code == 0

        deadline = time.monotonic() + 120
        while len(containers()) < 4 or not all(running(c) for c in containers()):
            assert time.monotonic() < deadline, "episodes never started"
            assert run.poll() is None, "episodes never started"
            time.sleep(0.5)  # polling other processes (sync test)
        os.kill(run.pid, getattr(signal, sig))
        _, err = run.communicate(timeout=120)
        assert run.returncode == 130, err.decode()[-2000:]
        assert "swectl: interrupted; the containers of this run were removed" in err.decode(), err.decode()[-2000:]
        assert containers() == []
        assert (tmp_path / "run" / "swectl.log").is_file()
    finally:
        server.terminate()
        server.wait(10)


def test_eval_against_an_openai_compatible_endpoint(model: Path, tmp_path: Path) -> None:
    """Messages-only episodes against /v1/chat/completions (here the CPU engine's): every artifact, no tokens."""
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, "-m", "swectl.remote.programs.cpu_engine", "--model", str(model),
                               "--port", "0", "--served-model-name", "tiny"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()
        assert line.startswith("ready on "), line
        url = line.split()[-1] + "/v1"
        out = tmp_path / "run"
        assert main(["eval", "--openai-url", url, "--openai-model", "tiny", "--slice", "0:2", "--step-limit", "2",
                     "--max-tokens", "16", "--out", str(out)]) == 0
    finally:
        server.terminate()
        server.wait(10)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] == 2
    assert summary["infra_errors"] == 0
    assert summary["model"] == "tiny"
    for line in (out / "results.jsonl").read_text().splitlines():
        ep = json.loads((Path(json.loads(line)["artifacts"]) / "traj.json").read_text())["episode"]
        assert ep["trajectory"]["token_ids"] == []
        assert ep["trajectory"]["messages"][0]["role"] == "system"
        assert [m["role"] for m in ep["trajectory"]["messages"][2:4]] == ["assistant", "user"]
