"""A replay policy: an engine that answers with recorded replies (a trajectory's actions) instead of a model.

For tests and benchmarks: the engine is never the bottleneck, and replaying gold-solving trajectories must
resolve every task through the whole path (agent loop, sandbox, grader). Replies are tokenized with the
policy's tokenizer, so the token bookkeeping is exercised exactly as with a model.
"""

from __future__ import annotations

import base64
import time

from swectl.agent.protocol import SUBMIT_SENTINEL
from swectl.agent.trajectory import ChatTokenizer
from swectl.engine.wire import GenerateRequest, GenerateResult

SUBMIT_REPLY = (f"THOUGHT: The fix is in place; submitting.\n\n```bash\necho {SUBMIT_SENTINEL} && git add -A && "
                "git diff --cached\n```")


def gold_replies(patch: str) -> list[str]:
    """Replies that apply ``patch`` (from base64: any bytes survive the bash block) and submit."""
    blob = base64.b64encode(patch.encode("utf-8", errors="surrogateescape")).decode()
    apply = (f"THOUGHT: I know the fix; writing it as a patch and applying it.\n\n```bash\n"
             f"echo {blob} | base64 -d > /tmp/fix.diff && git apply /tmp/fix.diff && rm /tmp/fix.diff && "
             "git status --short\n```")
    return [apply, SUBMIT_REPLY]


class ReplayEngine:
    """Answers each generate call with the next recorded reply, then the end-of-turn token."""

    def __init__(self, replies: list[str], tokenizer: ChatTokenizer, *, eos_token: str = "<|im_end|>",
                 weight_version: str = "replay") -> None:
        self._replies = list(replies)
        self._tok = tokenizer
        self._eos = tokenizer.convert_tokens_to_ids(eos_token)  # type: ignore[attr-defined]
        self._version = weight_version
        self.calls = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        started = time.monotonic()
        reply = self._replies[self.calls] if self.calls < len(self._replies) else "THOUGHT: nothing left to replay."
        self.calls += 1
        ids = [*self._tok.encode(reply, add_special_tokens=False), self._eos]
        cap = request.sampling_params.max_new_tokens
        finish = "length" if len(ids) > cap else "stop"
        ids = ids[:cap]
        took = time.monotonic() - started
        return GenerateResult(
            output_ids=ids, output_logprobs=[0.0] * len(ids), finish_reason=finish,
            prompt_tokens=len(request.input_ids), completion_tokens=len(ids), weight_version=self._version,
            e2e_latency_s=took, client_latency_s=took,
        )
