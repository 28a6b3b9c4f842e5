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
from view_runs import PATCH, make_up_run, metrics_row, steps_row, write_episode

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


def test_episodes_filter_by_sample_reward_and_weight_version(tmp_path: Path) -> None:
    path = make_up_run(tmp_path / "run")
    run = RunIndex(path)
    by_id = {r.id: r for r in run.episode_rows()}
    assert by_id["episodes/step_000002/calc-1__0"].reward == 1.0 and by_id["episodes/step_000002/calc-1__1"].reward == 0
    assert by_id["eval/step_000003/calc-1__0"].reward is None  # held-out readings are not rewarded
    assert all(r.resolved and r.phase == "train" for r in run.episode_rows(reward_min=0.5))
    assert len(run.episode_rows(reward_min=0.5)) == 5 and len(run.episode_rows(reward_max=0.0)) == 7
    assert [(r.step, r.sample) for r in run.episode_rows(instance_id="calc-2", sample=1)] == [(1, 1), (2, 1), (3, 1)]
    assert by_id["episodes/step_000001/calc-1__0"].weight_versions is None  # traj.json not read for the list
    assert [(r.step, r.sample) for r in run.episode_rows(weight_version="1", instance_id="calc-1")] == [(2, 0), (2, 1)]
    assert [r.id for r in run.episode_rows(weight_version="3")] == ["eval/step_000003/calc-1__0"]
    # a group whose rewards are written while its last episode is not: matched when it is, ABORTED ones skipped
    step4 = path / "episodes" / "step_000004"
    write_episode(step4 / "calc-1__0", "calc-1", 0, resolved=False, aborted=True)
    write_episode(step4 / "calc-1__1", "calc-1", 1, resolved=True)
    with (path / "steps.jsonl").open("a") as f:
        f.write(steps_row(4, {"calc-1": [1.0, 0.25]}))
    run.refresh()
    assert [r.reward for r in run.episode_rows(step=4)] == [None, None]
    write_episode(step4 / "calc-1__2", "calc-1", 2, resolved=False)
    run.refresh()
    assert [r.reward for r in run.episode_rows(step=4)] == [None, 1.0, 0.25]
    assert [r.sample for r in run.episode_rows(step=4, reward_min=0.1, reward_max=0.5)] == [2]


@pytest.mark.anyio
async def test_the_api_filters_by_reward_and_weight_version(tmp_path: Path) -> None:
    transport = httpx.ASGITransport(app=build_app([RunIndex(make_up_run(tmp_path / "run"))]))
    async with httpx.AsyncClient(transport=transport, base_url="http://view") as http:
        rows = (await http.get("/api/runs/0/episodes", params={"reward_min": "0.5", "weight_version": "0"})).json()
        assert [(r["id"], r["reward"], r["weight_versions"]) for r in rows] == [
            ("episodes/step_000001/calc-1__0", 1.0, ["0"]), ("episodes/step_000001/calc-1__1", 1.0, ["0"])]
        rows = (await http.get("/api/runs/0/episodes", params={"sample": "0", "reward_max": "0"})).json()
        assert [(r["instance_id"], r["step"]) for r in rows] == [("calc-2", 1), ("calc-2", 2), ("calc-2", 3)]
        assert (await http.get("/api/runs/0/episodes", params={"reward_min": "high"})).status_code == 400


def test_evaluation_readings_are_marked_on_the_resolve_rate_curve(tmp_path: Path) -> None:
    run = RunIndex(make_up_run(tmp_path / "run", eval_steps=(1, 3)))
    assert [(r["step"], r["eval/resolve_rate"]) for r in run.metrics if "eval/resolve_rate" in r] == [(1, 0.25),
                                                                                                    (3, 0.75)]
    page = export_html([run])
    assert 'key === "resolve_rate" ? series.map(s => s.evals)' in page and "eval-mark" in page


def test_tasks_count_groups_with_and_without_signal_and_mark_the_never_resolved(tmp_path: Path) -> None:
    path = make_up_run(tmp_path / "run")
    run = RunIndex(path)
    tasks = {t["instance_id"]: t for t in run.tasks()}
    # calc-1 resolves at both samples of odd steps (no signal) and at one of step 2's; calc-2 never
    assert (tasks["calc-1"]["groups_with_signal"], tasks["calc-1"]["groups_without_signal"]) == (1, 2)
    assert (tasks["calc-2"]["groups_with_signal"], tasks["calc-2"]["groups_without_signal"]) == (0, 3)
    assert tasks["calc-2"]["never_resolved"] and not tasks["calc-1"]["never_resolved"]
    # rewards decide when they are known: two unresolved episodes rewarded differently are a signal
    for sample in range(2):
        write_episode(path / "episodes" / "step_000004" / f"calc-2__{sample}", "calc-2", sample, resolved=False)
    with (path / "steps.jsonl").open("a") as f:
        f.write(steps_row(4, {"calc-2": [0.0, -0.5]}))
    run.refresh()
    assert {t["instance_id"]: t["groups_with_signal"] for t in run.tasks()}["calc-2"] == 1


def test_the_diff_reaches_the_page_as_written(tmp_path: Path) -> None:
    """The page colours it (file and hunk headers, added and removed lines, Python tokens: the browser test)."""
    run = RunIndex(make_up_run(tmp_path / "run"))
    e = run.episode("episodes/step_000001/calc-1__0")
    assert e["patch"] == PATCH and "@@ -1,2 +1,2 @@ def add(a, b):" in e["patch"]
    for css in (".hunk", ".file", ".kw", ".str", ".com", ".num", ".add", ".del"):
        assert css + " {" in export_html([run])


def test_one_episode_shows_context_cuts_format_errors_and_the_failed_tests(tmp_path: Path) -> None:
    path = make_up_run(tmp_path / "run")
    run = RunIndex(path)
    e = run.episode("eval/step_000003/calc-1__0")
    assert e["context_cuts"] == [{"turn": 2, "omitted_turns": 3}] and e["format_errors"] == [2]
    assert [(s["prompt_tokens"], s["output_tokens"]) for s in e["samples"]] == [(100, 20), (150, 20)]
    assert e["row"]["weight_versions"] == ["3"]
    failed = run.episode("episodes/step_000001/calc-2__1")
    assert failed["context_cuts"] == [] and failed["format_errors"] == [2]
    assert failed["grade"]["f2p_failed"] == ["tests/test_calc.py::test_add"]
    assert failed["grade"]["p2p_failed"] == ["tests/test_calc.py::test_sub"] and failed["grade"]["test_exit_code"] == 1
    # a run copied from elsewhere: its grading logs are found at the same place in the run folder
    logs = path / "episodes" / "step_000001" / "grade-logs"
    logs.mkdir()
    (logs / "calc-2.rollout1.log").write_text("FAILED tests/test_calc.py::test_sub\n")
    meta = json.loads((path / "episodes" / "step_000001" / "calc-2__1" / "meta.json").read_text())
    meta["grade"]["log_path"] = "/cluster/runs/r1/episodes/step_000001/grade-logs/calc-2.rollout1.log"
    (path / "episodes" / "step_000001" / "calc-2__1" / "meta.json").write_text(json.dumps(meta))
    moved = run.episode("episodes/step_000001/calc-2__1")
    assert "FAILED tests/test_calc.py::test_sub" in moved["log"] and not moved["problems"]


def test_an_episode_names_the_others_of_its_group_to_compare_with(tmp_path: Path) -> None:
    run = RunIndex(make_up_run(tmp_path / "run"))
    assert run.episode("episodes/step_000002/calc-1__0")["group"] == ["episodes/step_000002/calc-1__1"]
    assert run.episode("eval/step_000003/calc-1__0")["group"] == []


def test_rewards_jsonl_gives_each_episode_its_reward_by_sample_also_in_async_group_folders(tmp_path: Path) -> None:
    path = make_up_run(tmp_path / "run")
    group = path / "episodes" / "group_000007"  # the async loop's folders: no steps.jsonl rewards for them
    for sample in (0, 1):
        write_episode(group / f"calc-1__{sample}", "calc-1", sample, resolved=bool(sample))
    run = RunIndex(path)
    assert [r.reward for r in run.episode_rows() if r.id.startswith("episodes/group_")] == [None, None]
    with (group / "rewards.jsonl").open("w") as f:  # written by the loop when the group is scored (not in order)
        f.write(json.dumps({"instance_id": "calc-1", "sample": 1, "reward": 1.0, "advantage": 0.7}) + "\n")
        f.write(json.dumps({"instance_id": "calc-1", "sample": 0, "reward": -0.5, "advantage": -0.7}) + "\n")
        f.write('{"instance_id": "calc-1", "sam')  # a line still being written waits
    run.refresh()
    assert [(r.sample, r.reward) for r in run.episode_rows() if r.id.startswith("episodes/group_")] == [
        (0, -0.5), (1, 1.0)]
    # an exact reward wins over the steps.jsonl match of the same step's group
    step2 = path / "episodes" / "step_000002"
    (step2 / "rewards.jsonl").write_text(json.dumps({"instance_id": "calc-1", "sample": 0, "reward": 0.3,
                                                     "advantage": 0.0}) + "\n")
    run.refresh()
    assert RunIndex(path).episodes["episodes/step_000002/calc-1__0"].reward == 0.3
