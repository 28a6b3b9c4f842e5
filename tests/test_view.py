"""`swectl view`'s index and API on run folders written with the product's own structs: curves, filters, tasks,
one episode in full, a run still being written, bad input, the self-contained export."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from view_runs import make_up_run, metrics_row, write_episode

from swectl.errors import ConfigError
from swectl.view.app import build_app, export_html
from swectl.view.index import OBSERVATION_SHOWN_CHARS, RunIndex


def test_the_index_reads_curves_episodes_and_tasks(tmp_path: Path) -> None:
    run = RunIndex(make_up_run(tmp_path / "run", steps=3))
    assert run.kind == "up" and [r["step"] for r in run.metrics if "reward_mean" in r] == [1, 2, 3]
    assert len(run.episodes) == 3 * 4 + 1
    assert {r.phase for r in run.episodes.values()} == {"train", "eval"}
    step2 = run.episode_rows(phase="train", step=2)
    assert [(r.instance_id, r.sample, r.resolved) for r in step2] == [
        ("calc-1", 0, True), ("calc-1", 1, False), ("calc-2", 0, False), ("calc-2", 1, False)]
    assert all(r.exit_status == "LimitsExceeded" for r in run.episode_rows(resolved=False))
    tasks = {t["instance_id"]: t for t in run.tasks()}
    assert tasks["calc-2"]["resolved"] == 0 and tasks["calc-1"]["steps"]["train:1"] == [2, 2]
    assert run.tasks()[-1]["instance_id"] == "calc-2"  # the task that never resolves comes last


def test_one_episode_shows_its_turns_diff_verdict_and_log(tmp_path: Path) -> None:
    run = RunIndex(make_up_run(tmp_path / "run"))
    [resolved] = run.episode_rows(phase="eval")
    e = run.episode(resolved.id)
    assert "+return a + b" in e["patch"] and e["grade"]["status"] == "resolved"
    assert [m["role"] for m in e["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert e["steps"][1]["format_error"] and e["weight_versions"] == ["3", "3"]
    assert "PASSED" in e["log"] and not e["problems"]
    failed = run.episode(run.episode_rows(instance_id="calc-2")[0].id)
    assert failed["grade"]["f2p_failed"] == ["tests/test_calc.py::test_add"] and failed["patch"] == ""
    with pytest.raises(KeyError):
        run.episode("../../etc")


def test_a_run_being_written_is_picked_up_and_partial_lines_wait(tmp_path: Path) -> None:
    path = make_up_run(tmp_path / "run", steps=2)
    run = RunIndex(path)
    with (path / "metrics.jsonl").open("a") as f:
        f.write(metrics_row(3, 0.9)[:20])  # a line being written
    run.refresh()
    assert max(r["step"] for r in run.metrics) == 2
    with (path / "metrics.jsonl").open("a") as f:
        f.write(metrics_row(3, 0.9)[20:])
    (path / "episodes" / "step_000003" / "calc-1__0").mkdir(parents=True)  # meta.json not written yet
    run.refresh()
    assert max(r["step"] for r in run.metrics) == 3 and not run.episode_rows(step=3)
    write_episode(path / "episodes" / "step_000003" / "calc-1__1", "calc-1", 1, resolved=True)
    run.refresh()
    assert [r.sample for r in run.episode_rows(step=3)] == [1]


def test_bad_input_is_shown_not_fatal(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a run folder"):
        RunIndex(tmp_path)
    path = make_up_run(tmp_path / "run", steps=1)
    huge = "x" * (OBSERVATION_SHOWN_CHARS * 3)
    write_episode(path / "eval" / "step_000001" / "calc-2__0", "calc-2", 0, resolved=False, observation=huge)
    broken = path / "episodes" / "step_000001" / "calc-1__0"
    (broken / "traj.json").unlink()
    (broken / "patch.diff").write_bytes(b"+caf\xe9\n")  # not UTF-8
    run = RunIndex(path)
    cut = run.episode("eval/step_000001/calc-2__0")["messages"][3]
    assert cut["cut"] and cut["chars"] == len(huge) and len(cut["content"]) < OBSERVATION_SHOWN_CHARS + 100
    e = run.episode("episodes/step_000001/calc-1__0")
    assert any("traj.json" in p for p in e["problems"]) and "caf\ufffd" in e["patch"]


@pytest.mark.anyio
async def test_the_api_answers_and_keys_guard_it(tmp_path: Path) -> None:
    runs = [RunIndex(make_up_run(tmp_path / "a")), RunIndex(make_up_run(tmp_path / "b", steps=2))]
    transport = httpx.ASGITransport(app=build_app(runs))
    async with httpx.AsyncClient(transport=transport, base_url="http://view") as http:
        summaries = (await http.get("/api/runs")).json()
        assert [s["steps"] for s in summaries] == [3, 2] and summaries[0]["config"]["train"]["steps"] == 3
        assert len((await http.get("/api/runs/1/metrics")).json()) == 3
        rows = (await http.get("/api/runs/0/episodes", params={"resolved": "true", "step": "1"})).json()
        assert [(r["instance_id"], r["sample"]) for r in rows] == [("calc-1", 0), ("calc-1", 1)]
        assert (await http.get("/api/runs/0/episodes", params={"step": "x"})).status_code == 400
        e = (await http.get("/api/runs/0/episode", params={"id": rows[0]["id"]})).json()
        assert e["row"]["id"] == rows[0]["id"] and "+return a + b" in e["patch"]
        assert (await http.get("/api/runs/0/episode", params={"id": "nope"})).status_code == 404
        assert (await http.get("/api/runs/7/metrics")).status_code == 404
        assert "swectl view" in (await http.get("/")).text
    keyed = httpx.ASGITransport(app=build_app(runs, api_key="k3y"))
    async with httpx.AsyncClient(transport=keyed, base_url="http://view") as http:
        assert (await http.get("/api/runs")).status_code == 401
        assert (await http.get("/api/runs", params={"key": "k3y"})).status_code == 200


def test_the_export_holds_every_answer_and_no_outside_script(tmp_path: Path) -> None:
    runs = [RunIndex(make_up_run(tmp_path / "a"))]
    html = export_html(runs)
    assert not re.search(r"<script[^>]+src=", html) and "http://" not in html.split("<script>", 1)[1].split("ns =")[0]
    blob = html.split("window.SWECTL_DATA = ", 1)[1].split(";</script>", 1)[0]
    data = json.loads(blob)
    episodes = data["/api/runs/0/episodes"]
    assert len(episodes) == 13 and all(f"/api/runs/0/episode?id={r['id'].replace('/', '%2F')}" in data
                                       for r in episodes)


def test_the_command_refuses_a_public_address_without_a_key_and_writes_the_export(tmp_path: Path) -> None:
    run = make_up_run(tmp_path / "run")
    cli = [sys.executable, "-m", "swectl.cli.main", "view"]
    refused = subprocess.run([*cli, "--host", "0.0.0.0", str(run)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--api-key-file" in refused.stderr
    out = tmp_path / "report.html"
    done = subprocess.run([*cli, "--html", str(out), str(run)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "13 episodes" in done.stderr and "window.SWECTL_DATA" in out.read_text()
    missing = subprocess.run([*cli, str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such folder" in missing.stderr
