"""Token-in, token-out trajectories (docs/architecture.md 6.2).

The chat template renders the prompt once; afterwards the engine's output tokens are appended as they
came (loss mask 1, with their logprobs and the weight version that produced them) and every observation is
appended as the template tokens that the chat template would add for it (loss mask 0). Re-tokenizing the
whole conversation afterwards is never needed.

Before each observation the builder checks that the template is append-only for this conversation: the
rendering of the conversation so far must be a prefix of the rendering with the new message. Where it is
not (templates that rewrite earlier turns, e.g. strip reasoning), the builder realigns: it keeps the
longest common token prefix and appends the rest of the new rendering with mask 0, since the origin of
those tokens is lost. Realignments are counted.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec


class ChatTokenizer(Protocol):
    """What the builder needs of a Hugging Face tokenizer."""

    def apply_chat_template(self, conversation: list[dict[str, str]], **kw: Any) -> Any: ...
    def encode(self, text: str, **kw: Any) -> list[int]: ...
    def decode(self, ids: list[int], **kw: Any) -> str: ...


class Message(msgspec.Struct, frozen=True):
    """One chat message (role, content)."""
    role: str
    content: str


class Trajectory(msgspec.Struct, kw_only=True):
    """The token-level record of an episode: ids, loss mask, logprobs and weight versions."""
    token_ids: list[int] = []
    loss_mask: list[int] = []  # 1: emitted by the engine (trained on); 0: prompt, observation, template
    logprobs: list[float] = []  # the engine's logprob for mask-1 tokens, 0.0 elsewhere
    weight_versions: list[str] = []  # one per assistant turn
    messages: list[Message] = []
    prompt_length: int = 0
    realignments: int = 0
    # the episode's turn number (0-based) of each trained span, in order; [] when span i is turn i (swectl's own
    # loop). An external harness's episode, recorded by the gateway in branches, numbers its spans so.
    turns: list[int] = []

    def check(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == n):
            raise AssertionError(f"trajectory arrays differ in length: {n}, {len(self.loss_mask)}, "
                                 f"{len(self.logprobs)}")


def rendered_ids(rendered: Any) -> list[int]:
    """apply_chat_template(tokenize=True) gives a list, or a BatchEncoding-like mapping in transformers 5."""
    ids = rendered if isinstance(rendered, list) else rendered["input_ids"]
    if type(ids) is list and (not ids or type(ids[0]) is int):  # a tokenizer's own list: a copy (1 us, not 60)
        return list(ids)
    return list(map(int, ids))  # a tensor's or an array's ids become plain ints


class TrajectoryBuilder:
    """Builds a Trajectory turn by turn from engine outputs and templated observations."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tok = tokenizer
        self.traj = Trajectory()
        # decode(token_ids[:_decoded_n]), extended as tokens are appended, so a step decodes only its new tokens
        self._decoded_n = 0
        self._decoded = ""

    def _emitted_text(self, *, incremental: bool = True) -> str:
        ids = self.traj.token_ids
        if not incremental or self._decoded_n > len(ids):
            self._decoded_n, self._decoded = 0, ""
        if self._decoded_n < len(ids):
            self._decoded += self._tok.decode(ids[self._decoded_n:], skip_special_tokens=False)
            self._decoded_n = len(ids)
        return self._decoded

    def _render_text(self, messages: list[Message], *, generation_prompt: bool) -> str:
        conv = [{"role": m.role, "content": m.content} for m in messages]
        return self._tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=generation_prompt)

    def _render_ids(self, messages: list[Message], *, generation_prompt: bool) -> list[int]:
        conv = [{"role": m.role, "content": m.content} for m in messages]
        return rendered_ids(self._tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=generation_prompt))

    def start(self, system: str, user: str) -> list[int]:
        """Render the prompt once; returns the ids to send to the engine."""
        t = self.traj
        t.messages = [Message("system", system), Message("user", user)]
        t.token_ids = self._render_ids(t.messages, generation_prompt=True)
        t.loss_mask = [0] * len(t.token_ids)
        t.logprobs = [0.0] * len(t.token_ids)
        t.prompt_length = len(t.token_ids)
        return list(t.token_ids)

    def add_output(self, output_ids: list[int], logprobs: list[float], weight_version: str) -> str:
        """Append the engine's tokens exactly as emitted; returns their text (the assistant message)."""
        if len(output_ids) != len(logprobs):
            raise ValueError(f"{len(output_ids)} output ids but {len(logprobs)} logprobs")
        t = self.traj
        t.token_ids += output_ids
        t.loss_mask += [1] * len(output_ids)
        t.logprobs += [float(x) for x in logprobs]
        t.weight_versions.append(weight_version)
        text = self._tok.decode(output_ids, skip_special_tokens=True)
        t.messages.append(Message("assistant", text))
        return text

    def add_observation(self, content: str) -> list[int]:
        """Append a user message (observation) as the template's tokens, mask 0; returns the full ids for the
        next generate call."""
        t = self.traj
        before = self._render_text(t.messages, generation_prompt=False)
        after_messages = [*t.messages, Message("user", content)]
        after = self._render_text(after_messages, generation_prompt=True)
        if after.startswith(before):
            # Append-only: the new tokens are the rendering of the suffix. Our tokens so far stand for
            # `before` minus whatever the template adds after an assistant message (e.g. "\n" after the
            # end-of-turn token), which the engine did not emit: take it from the suffix.
            emitted = self._emitted_text()
            if not before.startswith(emitted):
                # Decoding piecewise can differ from decoding whole where a piece ends inside a character.
                emitted = self._emitted_text(incremental=False)
            if before.startswith(emitted):
                suffix = after[len(emitted):]
                new = self._tok.encode(suffix, add_special_tokens=False)
                t.token_ids += new
                t.loss_mask += [0] * len(new)
                t.logprobs += [0.0] * len(new)
                t.messages = after_messages
                return list(t.token_ids)
        self._realign(after_messages)
        return list(t.token_ids)

    def _realign(self, messages: list[Message]) -> None:
        t = self.traj
        full = self._render_ids(messages, generation_prompt=True)
        keep = 0
        for a, b in zip(t.token_ids, full, strict=False):
            if a != b:
                break
            keep += 1
        t.token_ids = t.token_ids[:keep] + full[keep:]
        t.loss_mask = t.loss_mask[:keep] + [0] * (len(full) - keep)
        t.logprobs = t.logprobs[:keep] + [0.0] * (len(full) - keep)
        t.messages = messages
        t.realignments += 1
        self._decoded_n, self._decoded = 0, ""
