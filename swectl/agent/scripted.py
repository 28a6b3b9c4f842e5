"""A scripted policy: an ``Engine`` (swectl.agent.loop) that "generates" replies written in advance.

Each generate call answers with the next scripted reply as the policy's tokenizer encodes it, followed by the
end-of-turn token the chat template puts after an assistant message (``<|im_end|>`` for ChatML), with logprob
0.0 for every token and weight version ``"gold"``. So an episode driven by a script runs through the real agent
loop in a real sandbox and leaves a trajectory in exactly the format of model episodes (the mask-1 tokens are
the scripted replies). Pure: no I/O.

A reply longer than the request's ``max_new_tokens`` is cut there (finish reason ``length``), as a model's
would be. A request past the end of the script is answered with finish reason ``abort``: the loop ends the
episode ABORTED with the reason, never scored.
"""

from __future__ import annotations

import time
from typing import Any

from swectl.agent.trajectory import ChatTokenizer
from swectl.engine.wire import GenerateRequest, GenerateResult
from swectl.errors import ConfigError

GOLD_WEIGHT_VERSION = "gold"
_MARK = "\x00swectl-end-of-turn-probe\x00"


def end_of_turn_id(tokenizer: Any) -> int:
    """The token the chat template writes right after an assistant message's content (the end-of-turn token the
    model must emit), else the tokenizer's eos token; ConfigError when there is neither."""
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}]
    rendered = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)
    after = rendered.split(_MARK, 1)[1] if _MARK in rendered else ""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    if after:
        ids = tokenizer.encode(after, add_special_tokens=False)
        if ids and ids[0] in special:
            return int(ids[0])
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return eos
    raise ConfigError("the tokenizer's chat template ends an assistant turn with no special token and the tokenizer "
                      "has no eos token: cannot tell which token ends a scripted reply")


class ScriptedEngine:
    """Answers each generate call with the next scripted reply's tokens plus the end-of-turn token."""

    def __init__(self, replies: list[str], tokenizer: ChatTokenizer, *, eot_id: int | None = None,
                 weight_version: str = GOLD_WEIGHT_VERSION) -> None:
        self._tok = tokenizer
        self._eot = end_of_turn_id(tokenizer) if eot_id is None else eot_id
        self._replies = [[*tokenizer.encode(r, add_special_tokens=False), self._eot] for r in replies]
        self._version = weight_version
        self.calls = 0

    def reply_ids(self, n: int) -> list[int]:
        """The tokens of scripted reply ``n`` (its text, then the end-of-turn token)."""
        return list(self._replies[n])

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        started = time.monotonic()
        n = _step(request.rid, self.calls)
        self.calls += 1
        common = {"prompt_tokens": len(request.input_ids), "weight_version": self._version, "rid": request.rid}
        if n >= len(self._replies):
            took = time.monotonic() - started
            return GenerateResult(output_ids=[], output_logprobs=[], finish_reason="abort", completion_tokens=0,
                                  e2e_latency_s=took, client_latency_s=took,
                                  finish_message=f"the script has {len(self._replies)} replies; turn {n + 1} asked "
                                  "for one more (the episode did not end where the script expected)", **common)
        ids = self._replies[n]
        cap = request.sampling_params.max_new_tokens
        finish = "length" if len(ids) > cap else "stop"
        ids = ids[:cap]
        took = time.monotonic() - started
        return GenerateResult(output_ids=list(ids), output_logprobs=[0.0] * len(ids), finish_reason=finish,
                              completion_tokens=len(ids), e2e_latency_s=took, client_latency_s=took,
                              matched_stop=self._eot if finish == "stop" else None, **common)


def _step(rid: str | None, calls: int) -> int:
    """The turn a request is for: the loop's rids end in ``/<step>``; otherwise the number of calls so far."""
    if rid and "/" in rid:
        tail = rid.rsplit("/", 1)[1]
        if tail.isdigit():
            return int(tail)
    return calls
