"""The one report shape of ``swectl eval``: ``RunReport`` holds what every run reports; patch grading's
``report.json`` (swectl/eval/patches.py) and an agent run's ``summary.json`` (swectl/eval/agents.py) extend it.

Counting, the same for both: ``total`` is what the run set out to grade (patches, or tasks x samples);
``infra_errors`` never got a verdict (the sandbox, the engine or the node failed); ``resolve_rate`` is
``resolved`` over what got a verdict.
"""

from __future__ import annotations

from typing import Literal

import msgspec

REPORT_FORMAT = 2

Mode = Literal["gold", "empty", "predictions", "model", "endpoint", "openai"]


class RunReport(msgspec.Struct, kw_only=True):
    """What every ``swectl eval`` run reports; the drivers' reports extend it."""

    """The summary of an eval run (summary.json): mode, model, tasks and the counts."""
    format_version: int = REPORT_FORMAT
    mode: Mode
    model: str = ""  # model_name_or_path: of the predictions, or the model the agent ran ("" for gold/empty)
    tasks: str = ""  # the task source (--tasks)
    total: int
    resolved: int
    infra_errors: int
    resolve_rate: float  # resolved / (graded - infra_errors)
    elapsed_s: float


def resolve_rate(resolved: int, graded: int, infra_errors: int) -> float:
    judged = graded - infra_errors
    return round(resolved / judged, 4) if judged > 0 else 0.0
