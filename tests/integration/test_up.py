"""`swectl up` end to end with real sandboxes, the CPU engine and 2 torchrun ranks (the tiny session model):

- the controller killed with SIGKILL mid-run, then ``--resume``: the run's records show every step once, the
  tasks in exactly the data source's order (none repeated, none skipped), and metrics for every step;
- one trainer rank killed mid-run: the run notices, restarts the workers from the last checkpoint and
  finishes, with the same records;
- the engine server killed, then its supervisor, during asynchronous GRPO: the run goes on by itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swectl.actors.data_source import DataSource, split_tasks
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.sources import load_tasks
from swectl.testing import chaos

from .test_trainer import _rank_pids

pytestmark = [pytest.mark.integration]
STEPS = 4
TASKS_PER_STEP = 2


def _argv(model: Path, out: Path, run_id: str, *extra: str) -> list[str]:
    sets = {"out_dir": repr(str(out)), "run_id": repr(run_id), "train.model": repr(str(model)),
            "train.sampling.tasks_per_step": TASKS_PER_STEP, "train.sampling.n_samples": 2,
            "train.sampling.dynamic_sampling": "false",
            "train.save_every": 1, "rollout.step_limit": 1, "rollout.max_tokens": 16, "env_pool.warm": 0,
            "train.concurrency": 4}
    argv = [sys.executable, "-m", "swectl.cli.main", "up", "--recipe", "train", "--steps", str(STEPS)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    return argv + list(extra)


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in _lines(run / "steps.jsonl")):
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    pytest.fail(f"step {step} not reached in {timeout_s} s")


def _check_records(run: Path) -> None:
    steps = _lines(run / "steps.jsonl")
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1)), steps
    tasks = [t for r in steps for t in r["tasks"]]
    train, _ = split_tasks(load_tasks(BUNDLED_TASKS).tasks, 0.5, 0)
    expected = [t.instance_id for t in DataSource(train, seed=0).next(STEPS * TASKS_PER_STEP)]
    assert tasks == expected  # nothing repeated, nothing skipped, the seeded order
    metrics = [r for r in _lines(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert all(r["weight_version"] == r["step"] for r in metrics)
    state = json.loads((run / "checkpoints" / (run / "checkpoints" / "latest").read_text() / "controller.json")
                       .read_text())
    assert state["step"] == STEPS and state["cursor"]["consumed"] == expected
    for record in steps:  # each scored episode's reward beside its folder (what `swectl view` reads)
        folder = run / "episodes" / f"step_{record['step']:06d}"
        rewarded = _lines(folder / "rewards.jsonl")
        assert {r["instance_id"] for r in rewarded} == set(record["groups"])
        assert all((folder / f"{r['instance_id']}__{r['sample']}").is_dir() for r in rewarded)
    _check_rewards(run)


def test_sigkill_of_the_controller_then_resume_repeats_and_skips_nothing(model: Path, tmp_path: Path) -> None:
    run = tmp_path / "killed"
    proc = subprocess.Popen(_argv(model, tmp_path, "killed"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for_step(run, 2, proc)
        deadline = time.monotonic() + 60  # inside step 3: its episodes are running (a fast host ends a step in 1 s)
        while not (run / "episodes" / "step_000003").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 60  # the supervisors stop the engine and the ranks once their stdin closes
    while _rank_pids(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _rank_pids(str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "swectl.cli.main", "up", "--resume", str(run)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming after step" in done.stderr, done.stderr[-3000:]
    _check_records(run)


def _check_rewards(run: Path) -> None:
    """Each rewards.jsonl row names an episode once, and that episode finished and was graded: a group redone after
    a restart or resume gets a fresh folder (the abandoned attempt's moves to abandoned/), so no row of the
    abandoned attempt sits beside the redo's episodes, which may have been ABORTED."""
    for rewards in (run / "episodes").glob("*/rewards.jsonl"):
        rows = [(r["instance_id"], r["sample"]) for r in _lines(rewards)]
        assert len(rows) == len(set(rows)), f"{rewards}: an episode rewarded twice: {rows}"
        for instance_id, sample in rows:
            meta = json.loads((rewards.parent / f"{instance_id}__{sample}" / "meta.json").read_text())
            assert meta["outcome"] != "ABORTED" and not (meta.get("grade") or {}).get("infra"), (rewards, meta)


def _check_async_records(run: Path, n_steps: int = STEPS) -> None:
    """An async run's records: every step once, each task drawn either recorded in one step or pending (in flight
    at the end), never twice; the draws in the data source's order; no group staler than max_staleness 1."""
    steps = _lines(run / "steps.jsonl")
    assert [r["step"] for r in steps] == list(range(1, n_steps + 1)), steps
    recorded = [t for r in steps for t in r["tasks"]]
    assert len(recorded) == n_steps * TASKS_PER_STEP and len(set(recorded)) == len(recorded), recorded
    state = json.loads((run / "checkpoints" / (run / "checkpoints" / "latest").read_text() / "controller.json")
                       .read_text())
    consumed, pending = state["cursor"]["consumed"], state["cursor"]["pending"]
    train, _ = split_tasks(load_tasks(BUNDLED_TASKS).tasks, 0.5, 0)
    assert consumed == [t.instance_id for t in DataSource(train, seed=0).next(len(consumed))]
    assert sorted(recorded + pending) == sorted(consumed)
    metrics = [r for r in _lines(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in metrics] == list(range(1, n_steps + 1))
    assert all(r["staleness_max"] <= 1 for r in metrics)
    _check_rewards(run)


def _check_records_under_faults(run: Path, n_steps: int) -> None:
    """A run that met faults: every step once with its full share of groups and its metrics. Unlike
    _check_async_records, a task may be drawn and given up (its group's episodes aborted on every try while the
    engine was down): it is recorded among the step's tasks but trains nothing, and was never scored."""
    steps = _lines(run / "steps.jsonl")
    assert [r["step"] for r in steps] == list(range(1, n_steps + 1)), steps
    assert all(len(r["groups"]) == TASKS_PER_STEP and set(r["groups"]) <= set(r["tasks"]) for r in steps), steps
    metrics = [r for r in _lines(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in metrics] == list(range(1, n_steps + 1))
    _check_rewards(run)


def test_async_run_killed_then_resumed_trains_every_task_once(model: Path, tmp_path: Path) -> None:
    """train.sampling.max_staleness = 1: groups run while the trainer trains. SIGKILL mid-run with groups in flight and
    buffered, then --resume: those tasks are drawn again first and each is recorded in exactly one step.

    Twice the steps of the other runs: with groups sampled ahead, the steps after the second can follow it within a
    second or two, and a run killed after its last step leaves its resume nothing to train."""
    run = tmp_path / "async"
    n_steps = 2 * STEPS
    argv = _argv(model, tmp_path, "async", "--set", "train.sampling.max_staleness=1")
    argv[argv.index("--steps") + 1] = str(n_steps)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run, 2, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 60
    while _rank_pids(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    killed_at = json.loads((run / "checkpoints" / (run / "checkpoints" / "latest").read_text() / "controller.json")
                           .read_text())
    assert killed_at["step"] < n_steps, killed_at["step"]  # killed with steps left to train
    assert killed_at["cursor"]["pending"]  # groups run ahead of the trainer: some were in flight at the checkpoint
    done = subprocess.run([sys.executable, "-m", "swectl.cli.main", "up", "--resume", str(run)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming after step" in done.stderr and "async training" in done.stderr, done.stderr[-3000:]
    _check_async_records(run, n_steps)


def test_a_killed_trainer_rank_restarts_from_the_last_checkpoint(model: Path, tmp_path: Path) -> None:
    run = tmp_path / "rank"
    proc = subprocess.Popen(_argv(model, tmp_path, "rank"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        _wait_for_step(run, 2, proc)
        ranks = _rank_pids(str(tmp_path))
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "trainer lost" in err and "restart 1/" in err and "trainer0.log" in err
    _check_records(run)


def _fill(disk: Path, leave: int) -> Path:
    """A file that takes all but about ``leave`` bytes of ``disk`` while the run writes there too: the free space
    read, then taken; a run's write in between makes fallocate fail, so it reads again (bounded)."""
    filler = disk / "filler"
    for _ in range(20):
        size = shutil.disk_usage(disk).free - leave
        if subprocess.run(["fallocate", "-l", str(max(size, 0)), str(filler)], capture_output=True).returncode == 0:
            return filler
        filler.unlink(missing_ok=True)
        time.sleep(0.1)
    pytest.fail(f"could not fill {disk}")


def test_a_full_disk_during_a_step_is_waited_out_and_the_run_goes_on(model: Path, tmp_path: Path) -> None:
    """The run folder's own file system filled (128 KiB left: a step's weights or a checkpoint does not fit) after
    step 1, and emptied once the run said it met the full disk: the checkpoint is skipped or the step waits for room
    and restarts from the last checkpoint, and the run finishes with whole records (the chaos soak's disk_full met
    a step's weight write and ended the run)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(disk)], check=True)
    log = tmp_path / "stderr.log"  # off the full disk
    try:
        run = disk / "full"
        with log.open("w") as err_file:
            proc = subprocess.Popen(_argv(model, disk, "full", "--set", "trainer.disk_wait_s=300"),
                                    stdout=subprocess.DEVNULL, stderr=err_file, text=True)
            try:
                _wait_for_step(run, 1, proc)
                filler = _fill(disk, leave=128 * 1024)
                deadline = time.monotonic() + 300  # full until the run says it met it (a step writes weights)
                while "No space left on device" not in log.read_text() and time.monotonic() < deadline:
                    assert proc.poll() is None, log.read_text()[-3000:]
                    time.sleep(0.5)
                filler.unlink()
                proc.wait(timeout=900)
            finally:
                if proc.poll() is None:
                    proc.kill()
        err = log.read_text()
        assert proc.returncode == 0, err[-3000:]
        assert "No space left on device" in err, err[-3000:]
        assert "skipped" in err or "waiting up to 300 s (trainer.disk_wait_s)" in err, err[-3000:]
        _check_records(run)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_model_the_trainer_cannot_load_stops_the_run_at_once(model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in model.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    data = tmp_path / "sft.jsonl"
    row = {"messages": [{"role": "user", "content": "list the files"},
                        {"role": "assistant", "content": "THOUGHT: look.\n\n```bash\nls\n```"}]}
    data.write_text(json.dumps(row) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "swectl.cli.main", "up", "--recipe", "train", "--steps", "2",
         "--set", f"out_dir={str(tmp_path)!r}",
         "--set", "run_id='broken'", "--set", "train.algorithm='sft'", "--set", f"train.model={str(broken)!r}",
         "--set", f"train.data.sft_data=[{str(data)!r}]"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "exited with" in done.stderr and "while starting" in done.stderr and "trainer0.log" in done.stderr
    assert "restart" not in done.stderr  # a trainer that never came up is not retried
    assert not _rank_pids(str(tmp_path))


def test_distributed_weight_sync_broadcasts_and_writes_folders_only_for_checkpoints(model: Path,
                                                                                     tmp_path: Path) -> None:
    """trainer.weight_sync = "distributed": rank 0 and the CPU engine form a gloo weight group; steps that save no
    checkpoint push their weights over it (no folder on disk), a checkpoint step also writes its folder."""
    run = tmp_path / "dist"
    argv = _argv(model, tmp_path, "dist", "--set", "trainer.weight_sync='distributed'", "--set",
                 "trainer.weight_sync_bucket_mb=0.1", "--set", "train.save_every=2")
    argv[argv.index("--steps") + 1] = "3"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "weight group swectl-dist-0: trainer + 1 engine server(s) over gloo" in done.stderr, done.stderr[-3000:]
    assert "syncing from disk" not in done.stderr
    metrics = [r for r in _lines(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert all(r["sync_s"] > 0 for r in metrics if not r.get("skipped")), metrics
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["step_000002", "step_000003"]
    # step 2's episodes ran on version 1, which reached the engine only over the weight group (no folder exists)
    versions = set()
    for traj in (run / "episodes" / "step_000002").glob("*/traj.json"):
        versions.update(json.loads(traj.read_text())["episode"]["trajectory"]["weight_versions"])
    assert versions == {"1"}, versions


def test_a_malformed_sft_row_is_skipped_with_its_line_or_stops_the_run_with_strict(model: Path,
                                                                                  tmp_path: Path) -> None:
    data = tmp_path / "sft.jsonl"
    good = {"messages": [{"role": "user", "content": "list the files"},
                         {"role": "assistant", "content": "THOUGHT: look.\n\n```bash\nls\n```"}]}
    data.write_text(json.dumps(good) + "\n" + json.dumps({"messages": "not a list"}) + "\n")
    argv = [sys.executable, "-m", "swectl.cli.main", "up", "--recipe", "train", "--steps", "1",
            "--set", f"out_dir={str(tmp_path)!r}",
            "--set", "train.algorithm='sft'", "--set", f"train.model={str(model)!r}",
            "--set", f"train.data.sft_data=[{str(data)!r}]"]
    strict = subprocess.run([*argv, "--set", "run_id='strict'", "--strict"], capture_output=True, text=True,
                            timeout=300)
    assert strict.returncode == 2, strict.stderr[-3000:]
    assert f"{data}:2" in strict.stderr and "messages" in strict.stderr
    assert not (tmp_path / "strict" / "checkpoints").exists()
    lenient = subprocess.run([*argv, "--set", "run_id='lenient'"], capture_output=True, text=True, timeout=300)
    assert lenient.returncode == 0, lenient.stderr[-3000:]
    assert f"{data}:2" in lenient.stderr
    assert (tmp_path / "lenient" / "checkpoints" / "latest").exists()


def test_sft_steps_without_sft_data_make_the_gold_data_first_even_after_an_interrupted_try(model: Path,
                                                                                         tmp_path: Path) -> None:
    """The README's hint `swectl up --set train.data.sft_steps=N` on a fresh machine: the run makes gold trajectories of
    its train split in <run>/gold (that folder did not exist: FileNotFoundError), and a gold run cut short before
    (results without a summary) is made again instead of refused."""
    gold = tmp_path / "sftgold" / "gold"
    gold.mkdir(parents=True)
    (gold / "results.jsonl").write_text("{}\n")  # what an interrupted gold run leaves
    argv = _argv(model, tmp_path, "sftgold", "--set", "train.data.sft_steps=1", "--set", "rollout.max_tokens=512",
                 "--set", "rollout.step_limit=6")  # room for the gold scripts' turns
    argv[argv.index("--steps") + 1] = "2"  # one SFT step, then one GRPO step
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "holds an unfinished gold run" in done.stderr and "gold trajectories resolve and are kept" in done.stderr
    assert json.loads((gold / "summary.json").read_text())["resolved"] > 0
    assert _lines(tmp_path / "sftgold" / "metrics.jsonl"), "no step was recorded"


def test_engine_faults_during_async_grpo_are_survived(model: Path, tmp_path: Path) -> None:
    """Issue 62: asynchronous GRPO pushes weights every step, so an engine crash meets a push. The engine server is
    killed with SIGKILL after step 1, and its supervisor shell after step 3: the run goes on by itself (the push
    waits for the restart, the server dies with its supervisor and is restarted) and its records are whole."""
    run = tmp_path / "faults"
    n_steps = 2 * STEPS
    argv = _argv(model, tmp_path, "faults", "--set", "train.sampling.max_staleness=1", "--set",
                 "engine.health_interval_s=1")
    argv[argv.index("--steps") + 1] = str(n_steps)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run, 1, proc)
        os.kill(chaos.Run(controller=proc.pid, run_dir=run).engine_server(), signal.SIGKILL)
        _wait_for_step(run, 3, proc)
        server = chaos.Run(controller=proc.pid, run_dir=run).engine_server()
        supervisor = int(Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(supervisor, signal.SIGKILL)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert err.count("engine server 0 on local: restart") >= 2, err[-3000:]
    assert "no server is up" not in err
    _check_records_under_faults(run, n_steps)


def _inject(fault: str, run: chaos.Run, tries: int = 60) -> str:
    for _ in range(tries):  # a sandbox exists only while an episode runs
        try:
            return chaos.FAULTS[fault](run)
        except chaos.NoTarget:
            time.sleep(0.5)
    pytest.fail(f"{fault}: no target within {tries / 2:.0f} s")


def test_a_short_chaos_soak_sandbox_daemon_and_a_stopped_engine(model: Path, tmp_path: Path) -> None:
    """The short version of `just bench chaos`: during asynchronous GRPO a sandbox's PID 1 is killed, then the
    nsbox daemon, then the engine is stopped (SIGSTOP). The run finishes by itself with whole records, no aborted
    episode is scored, and it leaves nothing behind (processes, sandboxes and their records, mounts, shared
    memory, listening ports, containers)."""
    run_dir = tmp_path / "chaos"
    n_steps = 2 * STEPS
    argv = _argv(model, tmp_path, "chaos", "--set", "train.sampling.max_staleness=1", "--set",
                 "engine.health_interval_s=1", "--set", "engine.max_failures=2", "--set", "rollout.step_limit=2")
    argv[argv.index("--steps") + 1] = str(n_steps)
    before = chaos.footprint()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = chaos.Run(controller=proc.pid, run_dir=run_dir)
    try:
        _wait_for_step(run_dir, 1, proc)
        _inject("sandbox_kill", run)
        _inject("nsbox_kill", run)
        _wait_for_step(run_dir, 3, proc)
        stopped = run.engine_server()
        _inject("engine_stop", run)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "the nsbox daemon does not answer" in err and "starting it again" in err, err[-3000:]
    assert "failed health checks in a row" in err, err[-3000:]
    assert not Path(f"/proc/{stopped}").exists()  # the stopped server was killed, not left waiting
    _check_records_under_faults(run_dir, n_steps)
    for rewards in (run_dir / "episodes").glob("*/rewards.jsonl"):  # what was scored finished and was graded
        for row in _lines(rewards):
            meta = json.loads((rewards.parent / f"{row['instance_id']}__{row['sample']}" / "meta.json").read_text())
            assert meta["outcome"] != "ABORTED" and not (meta.get("grade") or {}).get("infra"), meta
    deadline = time.monotonic() + 30  # the daemon removes a reclaimed sandbox's scratch in the background
    while (left := chaos.leaks(before, chaos.footprint())) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == {}
