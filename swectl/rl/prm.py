"""Process rewards (``[reward.prm]``): what a judge model is asked about one agent step, how its answer becomes a
vote, and how votes become a step score. Pure; the sampling is actors/judge.py's.

The judge sees the issue, the last few steps before this one, the step (the agent's reply) and what it produced,
and answers with ``\\boxed{1}`` (the step moves toward a fix) or ``\\boxed{-1}``. It is sampled m times; the step's
score is the mean of the votes that parse, None when none does (never a made-up score). The episode's reward is
``outcome + step_coef * mean(step scores)`` over its scored steps (rl/groups.py).
"""

from __future__ import annotations

import re

import msgspec

JUDGE_SYSTEM = (
    "You review one step of an autonomous software engineer fixing a GitHub issue in a repository. The engineer "
    "works in a shell: each step is its reasoning and one bash command, followed by the command's output. Judge "
    "whether this step moves the work toward a correct fix (finding the relevant code, reproducing the bug, a "
    "correct edit, a useful test run, submitting a finished fix) or not (a wasted, wrong, harmful or malformed "
    "step). Think briefly, then end your answer with \\boxed{1} for a good step or \\boxed{-1} for a bad one."
)
_BOXED = re.compile(r"\\boxed\{\s*([+-]?\s*\d+)\s*\}")


class StepView(msgspec.Struct, frozen=True, kw_only=True):
    """One agent step as the judge sees it: the model's reply and the observation it got back."""
    step: int
    reply: str
    observation: str


class StepJudgement(msgspec.Struct, kw_only=True):
    """The judge's verdict on one step: parsed votes (+1/-1), unparseable answers, failed requests, the score."""
    step: int
    votes: list[int] = []
    unparseable: int = 0
    failures: int = 0
    score: float | None = None  # mean of the votes; None when no vote parsed


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - limit} characters left out ...]\n{text[-half:]}"


def judge_messages(problem: str, history: list[StepView], step: StepView, *, history_steps: int = 4,
                   max_chars: int = 2000) -> list[dict[str, str]]:
    """The judge's chat: the issue, the last ``history_steps`` steps (each clipped to ``max_chars``), the step."""
    earlier = history[-history_steps:] if history_steps else []
    lines = [f"The issue:\n{_clip(problem, 2 * max_chars)}"]
    if len(history) > len(earlier):
        lines.append(f"({len(history) - len(earlier)} earlier steps left out)")
    for h in earlier:
        lines.append(f"Step {h.step + 1}:\n{_clip(h.reply, max_chars)}\nOutput:\n{_clip(h.observation, max_chars)}")
    lines.append(f"The step to judge (step {step.step + 1}):\n{_clip(step.reply, max_chars)}\n"
                 f"Its output:\n{_clip(step.observation, max_chars)}")
    lines.append("Is this step good (\\boxed{1}) or bad (\\boxed{-1})?")
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": "\n\n".join(lines)}]


def parse_vote(answer: str) -> int | None:
    """The last ``\\boxed{...}`` of an answer as +1 or -1; None when there is none or it holds anything else."""
    found = _BOXED.findall(answer)
    if not found:
        return None
    value = found[-1].replace(" ", "")
    return {"1": 1, "+1": 1, "-1": -1}.get(value)


def judgement(step: int, answers: list[str | None]) -> StepJudgement:
    """The step's judgement from the judge's answers (None: that request failed)."""
    votes = [v for a in answers if a is not None for v in [parse_vote(a)] if v is not None]
    failures = sum(a is None for a in answers)
    unparseable = len(answers) - failures - len(votes)
    return StepJudgement(step=step, votes=votes, unparseable=unparseable, failures=failures,
                         score=sum(votes) / len(votes) if votes else None)


def process_bonus(scores: list[float | None], step_coef: float) -> float:
    """``step_coef`` times the mean of the scored steps; 0 when no step was scored."""
    scored = [s for s in scores if s is not None]
    return step_coef * sum(scored) / len(scored) if scored else 0.0
