"""Judge training data for process rewards (``[reward.prm]``): swectl episodes -> labelled step verdicts.

A judge model answers ``\\boxed{1}`` (the step moves toward a fix) or ``\\boxed{-1}`` for one agent step, shown as
``swectl.rl.prm.judge_messages`` renders it: the issue, the last steps before it, the step and its output. This
module rebuilds exactly that prompt for every step of recorded episodes (``traj.json`` runs of ``swectl eval
--model``, ``swectl data gold`` or a training run) and labels the steps whose verdict the episode itself settles:

- a malformed reply (no single bash block) is bad (-1), in any episode;
- every well-formed step of an episode that resolved its task is good (+1): it is on a path that worked;
- the final step of an episode that submitted without resolving the task is bad (-1): it submitted a non-fix
  (a give-up, a wrong edit);
- the other steps of an unresolved episode are left unlabelled: a first look is on the good path and the bad one
  alike, and the outcome alone cannot say which of them went wrong.

The rows are OpenAI-messages JSONL (``{"messages": [system, user, assistant]}`` plus ``label``, ``instance_id``,
``sample``, ``step``), which ``train.data.sft_data`` reads, so ``swectl up`` with ``train.algorithm = "sft"`` trains a
judge on them. The answer is the bare ``\\boxed{...}``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec

from swectl.agent.loop import Episode
from swectl.agent.protocol import SUBMIT_SENTINEL
from swectl.data.trajectories import META_FILE, read_episode, read_meta, trajectory_files
from swectl.errors import TaskDataError
from swectl.rl.prm import StepView, judge_messages

GOOD, BAD = 1, -1


class JudgeExample(msgspec.Struct, kw_only=True):
    """One labelled step: the judge's chat (system, user) and the verdict it should give."""

    instance_id: str
    sample: int
    step: int
    label: int  # +1 good, -1 bad
    messages: list[dict[str, str]]

    def row(self) -> dict[str, object]:
        """The JSONL row: the chat with the verdict as the assistant's answer, and where it came from."""
        answer = {"role": "assistant", "content": f"\\boxed{{{self.label}}}"}
        return {"messages": [*self.messages, answer], "label": self.label, "instance_id": self.instance_id,
                "sample": self.sample, "step": self.step}


class JudgeDataSummary(msgspec.Struct, kw_only=True):
    """What ``judge_examples`` read and labelled."""

    episodes: int = 0
    resolved_episodes: int = 0
    steps: int = 0
    good: int = 0
    bad: int = 0
    bad_malformed: int = 0
    bad_submission: int = 0
    unlabelled: int = 0
    unrecorded: int = 0  # last steps whose message the episode did not record (see step_views): no example
    skipped_episodes: list[str] = []  # "<traj.json>: why" (no messages recorded, no meta.json, unknown task)


def step_views(episode: Episode) -> list[StepView]:
    """Every step of a recorded episode as the judge saw it while the episode ran (``on_step``): the reply and the
    message that came back (for a submission, the command's output: the sentinel line and the patch). A last step
    whose message the episode did not record (its third malformed reply in a row, or the wall clock ran out) is
    left out: its prompt cannot be rebuilt exactly."""
    messages = episode.trajectory.messages
    views: list[StepView] = []
    for n, _ in enumerate(episode.steps):
        at = 2 + 2 * n  # [system, problem, reply 0, observation 0, reply 1, ...]
        if at >= len(messages) or messages[at].role != "assistant":
            break
        if at + 1 < len(messages):
            observation = messages[at + 1].content
        elif episode.exit_status == "Submitted":
            observation = f"{SUBMIT_SENTINEL}\n{episode.submitted}"
        else:
            break
        views.append(StepView(step=n, reply=messages[at].content, observation=observation))
    return views


def step_labels(episode: Episode, resolved: bool) -> dict[int, tuple[int, str]]:
    """The steps the episode settles: step -> (label, why). See the module docstring for the rules."""
    labels: dict[int, tuple[int, str]] = {}
    for step in episode.steps:
        if step.format_error:
            labels[step.step] = (BAD, "malformed")
        elif resolved:
            labels[step.step] = (GOOD, "resolved")
    if not resolved and episode.exit_status == "Submitted" and episode.steps:
        labels[episode.steps[-1].step] = (BAD, "submission")
    return labels


def judge_examples(paths: Iterable[str | Path], problems: Mapping[str, str], *, history_steps: int = 4,
                   max_chars: int = 2000) -> tuple[list[JudgeExample], JudgeDataSummary]:
    """Labelled judge prompts from the episodes under ``paths`` (run folders, episode folders or traj.json files);
    ``problems`` maps instance ids to problem statements. An episode without recorded messages, meta.json or a
    known task is skipped and named in the summary."""
    examples: list[JudgeExample] = []
    summary = JudgeDataSummary()
    why = Counter[str]()
    for path in trajectory_files(paths):
        try:
            episode = read_episode(path)
            meta = read_meta(path.parent / META_FILE, required_by="judge data")
        except TaskDataError as exc:
            summary.skipped_episodes.append(str(exc))
            continue
        assert meta is not None  # required_by: missing is an error
        problem = problems.get(episode.instance_id)
        if problem is None:
            summary.skipped_episodes.append(f"{path}: task {episode.instance_id} is not in the task set")
            continue
        views = step_views(episode)
        if not views:
            summary.skipped_episodes.append(f"{path}: no messages recorded (a chat endpoint's episode?)")
            continue
        summary.episodes += 1
        summary.resolved_episodes += meta.resolved
        labels = step_labels(episode, meta.resolved)
        summary.unrecorded += len(episode.steps) - len(views)
        for view in views:
            summary.steps += 1
            if view.step not in labels:
                summary.unlabelled += 1
                continue
            label, reason = labels[view.step]
            why[reason] += 1
            examples.append(JudgeExample(
                instance_id=episode.instance_id, sample=meta.sample, step=view.step, label=label,
                messages=judge_messages(problem, views[:view.step], view, history_steps=history_steps,
                                        max_chars=max_chars)))
    summary.good = why["resolved"]
    summary.bad_malformed, summary.bad_submission = why["malformed"], why["submission"]
    summary.bad = summary.bad_malformed + summary.bad_submission
    return examples, summary


def write_judge_data(examples: list[JudgeExample], out: Path) -> None:
    """``out`` as OpenAI-messages JSONL (written to a temporary name, then renamed: never half a file)."""
    if not examples:
        raise TaskDataError("no labelled step to write: the episodes hold no malformed reply, no resolved episode "
                            "and no unresolved submission")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with partial.open("w") as f:
        for example in examples:
            f.write(json.dumps(example.row()) + "\n")
    partial.replace(out)
