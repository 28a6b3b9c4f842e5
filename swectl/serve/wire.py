"""The pool-server API of OpenClaw-RL's ``swe-rl`` rollouts, as msgspec messages (JSON over HTTP).

Requests are decoded strictly into these types (a missing field or a wrong type is a 400 naming the field);
fields the client sends beyond these are ignored, as the original server does. Responses are plain objects
built by ``swectl.serve.fleet``; every one carries ``ok``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from swectl.errors import SwectlError

TESTBED = "/testbed"
# Bounds on what one request may ask for: a command's timeout, an evaluation's timeout (seconds).
Timeout = Annotated[float, msgspec.Meta(gt=0, le=24 * 3600)]
# A command's output returned whole up to this many bytes (a request may ask for less or more, up to 1 GiB).
DEFAULT_MAX_OUTPUT_BYTES = 16 * 1024 * 1024
OutputLimit = Annotated[int, msgspec.Meta(ge=1024, le=1024**3)]
# Where the service says it cut a command's output. The same words open the output, so a patch read from a cut
# output always carries them: /evaluate refuses such a patch (infra) instead of grading a corrupt diff.
CUT_MARK = "[swectl serve: OUTPUT CUT]"


class AllocateRequest(msgspec.Struct, kw_only=True):
    """A fresh sandbox: of ``image``, or of the image of ``instance_id`` when it is a task of the served set."""
    image: str = ""
    instance_id: str = ""


class LeaseRequest(msgspec.Struct, kw_only=True):
    """``/heartbeat`` and ``/close``."""
    lease_id: str


class ExecRequest(msgspec.Struct, kw_only=True):
    """One command in the lease's sandbox, killed inside it after ``timeout`` seconds."""
    lease_id: str
    command: str
    cwd: str = TESTBED
    timeout: Timeout = 180.0
    env: dict[str, str] = {}
    max_output_bytes: OutputLimit | None = None  # None: the service's --max-output-mb


class DiffRequest(msgspec.Struct, kw_only=True):
    """Every change under ``cwd`` (a git repository) as a patch."""
    lease_id: str
    cwd: str = TESTBED


class EvaluateRequest(msgspec.Struct, kw_only=True):
    """Grade ``patch`` in a fresh sandbox: by the task's tests (the Grader's rules, whatever ``eval_script`` says)
    when the lease's instance is a task of the served set, otherwise by ``eval_script``'s exit code (0 =
    resolved)."""
    lease_id: str
    patch: str = ""
    eval_script: str = ""
    cwd: str = TESTBED
    timeout: Timeout = 3600.0


class ApiError(SwectlError):
    """A request that fails: the HTTP status, the message, whether the infrastructure failed (the client's
    sample is then aborted, never scored), and for a lease that has ended its ``state`` (closed, expired, lost).

    A failure that no retry can mend (the lease has ended) is answered with status 200 and ``ok: false``: slime's
    ``http_utils.post`` retries every non-2xx answer (10 attempts, 1 s apart) and then raises without reading the
    body, while a 2xx with ``ok: false`` makes the swe-rl client raise at once."""

    def __init__(self, status: int, message: str, *, infra: bool = False, state: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.infra = infra
        self.state = state

    def body(self) -> dict[str, object]:
        return {"ok": False, "error": self.message, **({"infra": True} if self.infra else {}),
                **({"state": self.state} if self.state else {})}
