"""Run folders for the `swectl view` tests, written with the structs `swectl up` and `swectl eval` write them with
(agent.loop.Episode in traj.json, actors.rollout.EpisodeResult in meta.json)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from swectl.actors.grader import GradeResult
from swectl.actors.rollout import EpisodeResult
from swectl.agent.context import StepSample
from swectl.agent.loop import Episode, Step
from swectl.agent.trajectory import Message, Trajectory

PATCH = ("diff --git a/calc.py b/calc.py\nindex 1a2b3c4..5d6e7f8 100644\n--- a/calc.py\n+++ b/calc.py\n"
         "@@ -1,2 +1,2 @@ def add(a, b):\n-return a - b  # subtract\n+return a + b  # add\n print('sum', 2)\n")


def write_episode(folder: Path, instance_id: str, sample: int, *, resolved: bool, observation: str = "ok",
                  log: Path | None = None, weight_version: str = "3", omitted_turns: int = 0,
                  aborted: bool = False) -> None:
    """One episode folder; ``omitted_turns``: head+tail context management cut that many turns from the second
    step's prompt (its per-step samples are recorded); ``aborted``: it ended ABORTED, not graded."""
    folder.mkdir(parents=True, exist_ok=True)
    samples = [StepSample(step=n, prompt_ids=[1] * (100 + 50 * n), output_ids=[2] * 20, output_logprobs=[0.0] * 20,
                          weight_version=weight_version, omitted_turns=omitted_turns if n else 0)
               for n in range(2)] if omitted_turns else []
    episode = Episode(instance_id=instance_id, exit_status="Submitted" if resolved else "LimitsExceeded",
                      outcome="COMPLETED" if resolved else "TRUNCATED", patch=PATCH if resolved else "",
                      steps=[Step(step=0, action="cat calc.py", returncode=0, model_time_s=0.5, env_time_s=0.1,
                                  output_tokens=20),
                             Step(step=1, action="bad", format_error=True, output_tokens=20)],
                      samples=samples, trajectory=Trajectory(weight_versions=[weight_version] * 2, messages=[
                          Message(role="system", content="You are a helpful agent."),
                          Message(role="user", content=f"Fix the bug in {instance_id}."),
                          Message(role="assistant", content="THOUGHT: look\n```bash\ncat calc.py\n```"),
                          Message(role="user", content=observation),
                          Message(role="assistant", content="no bash block here")]))
    traj = {"format_version": episode.format_version, "episode": msgspec.to_builtins(episode), "config": {}}
    (folder / "traj.json").write_bytes(msgspec.json.encode(traj))
    (folder / "patch.diff").write_text(episode.patch)
    grade = GradeResult(instance_id=instance_id, status="resolved" if resolved else "unresolved",
                        f2p_failed=[] if resolved else ["tests/test_calc.py::test_add"],
                        p2p_failed=[] if resolved else ["tests/test_calc.py::test_sub"], f2p_total=1, p2p_total=2,
                        test_exit_code=0 if resolved else 1, log_path=str(log) if log else "")
    result = EpisodeResult(instance_id=instance_id, sample=sample, resolved=resolved, grade=None if aborted else grade,
                           exit_status="Aborted" if aborted else episode.exit_status,
                           outcome="ABORTED" if aborted else episode.outcome, turns=2, total_time_s=1.5,
                           artifacts=str(folder))
    (folder / "meta.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)))


def metrics_row(step: int, reward: float) -> str:
    return json.dumps({"step": step, "reward_mean": reward, "resolve_rate": reward, "loss": -0.1 * step,
                       "entropy": 0.5, "train_tokens_per_s": 1000.0 + step}) + "\n"


def steps_row(step: int, rewards: dict[str, list[float]]) -> str:
    """A line of steps.jsonl as the training loop writes it (the step's tasks, groups and their rewards)."""
    return json.dumps({"step": step, "tasks": list(rewards), "groups": list(rewards), "rewards": rewards}) + "\n"


def make_up_run(run: Path, steps: int = 3, eval_steps: tuple[int, ...] = ()) -> Path:
    """A `swectl up` run: ``steps`` steps of metrics and steps.jsonl, two tasks x two samples per step (calc-1
    resolves at every sample of odd steps and at sample 0 of even ones; calc-2 never), the weights of step N-1;
    evaluation readings after ``eval_steps`` (default: the last step) and one held-out episode, whose second step
    was cut to fit the context (head+tail)."""
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"train": {"steps": steps, "seed": 0}}))
    log = run / "grade.log"
    log.write_text("PASSED tests/test_calc.py::test_add\n")
    with (run / "metrics.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            f.write(metrics_row(step, step / (steps + 1)))
        for step in eval_steps or (steps,):
            f.write(json.dumps({"step": step, "eval/resolve_rate": 0.25 * step % 1, "eval/episodes": 4.0}) + "\n")
    with (run / "steps.jsonl").open("w") as f:
        for step in range(1, steps + 1):
            resolves = {task: [task == "calc-1" and sample <= step % 2 for sample in range(2)]
                        for task in ("calc-1", "calc-2")}
            for task, verdicts in resolves.items():
                for sample, resolved in enumerate(verdicts):
                    write_episode(run / "episodes" / f"step_{step:06d}" / f"{task}__{sample}", task, sample,
                                  resolved=resolved, log=log, weight_version=str(step - 1))
            f.write(steps_row(step, {task: [float(v) for v in verdicts] for task, verdicts in resolves.items()}))
    write_episode(run / "eval" / f"step_{steps:06d}" / "calc-1__0", "calc-1", 0, resolved=True, log=log,
                  weight_version=str(steps), omitted_turns=3)
    return run
