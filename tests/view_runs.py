"""Run folders for the `swectl view` tests, written with the structs `swectl up` and `swectl eval` write them with
(agent.loop.Episode in traj.json, actors.rollout.EpisodeResult in meta.json)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from swectl.actors.grader import GradeResult
from swectl.actors.rollout import EpisodeResult
from swectl.agent.loop import Episode, Step
from swectl.agent.trajectory import Message, Trajectory

PATCH = "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-return a - b\n+return a + b\n"


def write_episode(folder: Path, instance_id: str, sample: int, *, resolved: bool, observation: str = "ok",
                  log: Path | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    episode = Episode(instance_id=instance_id, exit_status="Submitted" if resolved else "LimitsExceeded",
                      outcome="COMPLETED" if resolved else "TRUNCATED", patch=PATCH if resolved else "",
                      steps=[Step(step=1, action="cat calc.py", returncode=0, model_time_s=0.5, env_time_s=0.1),
                             Step(step=2, action="bad", format_error=True)],
                      trajectory=Trajectory(weight_versions=["3", "3"], messages=[
                          Message(role="system", content="You are a helpful agent."),
                          Message(role="user", content=f"Fix the bug in {instance_id}."),
                          Message(role="assistant", content="THOUGHT: look\n```bash\ncat calc.py\n```"),
                          Message(role="user", content=observation),
                          Message(role="assistant", content="no bash block here")]))
    traj = {"format_version": episode.format_version, "episode": msgspec.to_builtins(episode), "config": {}}
    (folder / "traj.json").write_bytes(msgspec.json.encode(traj))
    (folder / "patch.diff").write_text(episode.patch)
    grade = GradeResult(instance_id=instance_id, status="resolved" if resolved else "unresolved",
                        f2p_failed=[] if resolved else ["tests/test_calc.py::test_add"], f2p_total=1, p2p_total=2,
                        log_path=str(log) if log else "")
    result = EpisodeResult(instance_id=instance_id, sample=sample, exit_status=episode.exit_status,
                           outcome=episode.outcome, resolved=resolved, grade=grade, turns=2, total_time_s=1.5,
                           artifacts=str(folder))
    (folder / "meta.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)))


def metrics_row(step: int, reward: float) -> str:
    return json.dumps({"step": step, "reward_mean": reward, "resolve_rate": reward, "loss": -0.1 * step,
                       "entropy": 0.5, "train_tokens_per_s": 1000.0 + step}) + "\n"


def make_up_run(run: Path, steps: int = 3) -> Path:
    """A `swectl up` run: ``steps`` steps of metrics, two tasks x two samples per step, one evaluation."""
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"train": {"steps": steps, "seed": 0}}))
    log = run / "grade.log"
    log.write_text("PASSED tests/test_calc.py::test_add\n")
    with (run / "metrics.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            f.write(metrics_row(step, step / (steps + 1)))
        f.write(json.dumps({"step": steps, "eval/resolve_rate": 0.5, "eval/episodes": 4.0}) + "\n")
    for step in range(1, steps + 1):
        for task in ("calc-1", "calc-2"):
            for sample in range(2):
                write_episode(run / "episodes" / f"step_{step:06d}" / f"{task}__{sample}", task, sample,
                              resolved=task == "calc-1" and sample <= step % 2, log=log)
    write_episode(run / "eval" / f"step_{steps:06d}" / "calc-1__0", "calc-1", 0, resolved=True, log=log)
    return run
