"""The task record every part of swectl shares: one SWE task in SWE-bench's schema plus the fields that
rows of SWE-bench 5.x, SWE-Gym, SWE-smith and swectl's own task factory carry.

Loaders (swectl.tasks.sources) normalise every row style into ``Task``; the grader, the image resolver and
``swectl data prepare`` only ever see ``Task``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

TaskSource = Literal["swe-bench", "swe-gym", "swe-smith", "swectl-synth", "harbor"]

# Where the repository lives inside every task image (SWE-bench's convention).
TESTBED = "/testbed"


class Task(msgspec.Struct, kw_only=True, frozen=True):
    """One task: a repository at a commit, a problem statement, the gold patch and the tests that grade it."""
    instance_id: str
    repo: str
    problem_statement: str
    # Tests that must go from failing to passing, and tests that must keep passing (lists, never JSON strings).
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str] = []
    base_commit: str = ""
    # The gold fix (a unified diff). For factory tasks: the reverse of the synthesised bug.
    patch: str = ""
    # Test changes applied by the eval script before the tests run (classic SWE-bench rows).
    test_patch: str = ""
    version: str = ""
    environment_setup_commit: str = ""
    hints_text: str = ""
    created_at: str = ""
    # Rows that carry their environment (SWE-bench 5.x, SWE-smith, factory): image, eval script, parser name
    # (a key of swebench's PARSER_REGISTRY) and eval type ("pass_and_fail" or "fail_only"). A Harbor task
    # (swectl.tasks.harbor): its verifier as eval_script, log_parser "harbor", eval_type "reward" (its reward file).
    image: str = ""
    eval_script: str = ""
    log_parser: str = ""
    eval_type: str = "pass_and_fail"
    # Applied to TESTBED and committed before anyone (agent or grader) sees the sandbox. Factory tasks
    # keep one image per project version and carry their bug here.
    setup_patch: str = ""
    source: TaskSource = "swe-bench"
    # Fields of the original row that swectl does not interpret (difficulty, created_by, ...), kept
    # verbatim so `swectl data prepare` round-trips the instance.
    extra: dict[str, Any] = {}

    def row(self) -> dict[str, Any]:
        """The task as a SWE-bench-schema dict (test lists as lists), extra fields merged back in."""
        out = msgspec.to_builtins(self)
        extra = out.pop("extra")
        return {**extra, **out}
