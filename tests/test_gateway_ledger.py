"""The gateway's token record and its OpenAI shapes (swectl/gateway/ledger.py, wire.py), without a server: a turn
whose rendering extends the record is appended, one that does not is a branch from the longest shared prefix with
the drift counted, and Qwen3 tool calls are parsed out of a completion."""

from __future__ import annotations

import json

import msgspec
import pytest

from swectl.gateway.ledger import Ledger
from swectl.gateway.wire import (
    ChatCompletionRequest,
    completion_body,
    completion_chunks,
    parse_tool_calls,
    template_messages,
)


def test_a_rendering_that_extends_the_record_is_appended_with_masks_and_logprobs() -> None:
    ledger = Ledger()
    branch = ledger.prompt([1, 2, 3])
    ledger.completion(branch, [10, 11], [-0.5, -0.25], "3")
    again = ledger.prompt([1, 2, 3, 10, 11, 4, 5])  # the history sent back as sampled, then an observation
    assert again is branch
    ledger.completion(branch, [12], [-1.0], "4")
    assert branch.token_ids == [1, 2, 3, 10, 11, 4, 5, 12]
    assert branch.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert branch.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0]
    assert branch.weight_versions == ["3", "4"]
    assert ledger.stats().branches == 0 and ledger.stats().drift_tokens == 0 and ledger.stats().turns == 2


def test_a_rewritten_history_branches_at_the_first_differing_token() -> None:
    ledger = Ledger()
    first = ledger.prompt([1, 2, 3])
    ledger.completion(first, [10, 11, 12], [-0.1, -0.2, -0.3], "1")
    # the harness re-rendered the reply differently (a template that strips reasoning, a rewritten tool call)
    second = ledger.prompt([1, 2, 3, 10, 99, 4])
    assert second is not first and len(ledger.branches) == 2
    assert second.token_ids == [1, 2, 3, 10, 99, 4]
    # the shared prefix is context: its sampled token (10) is trained once, in the branch that sampled it
    assert second.loss_mask == [0, 0, 0, 0, 0, 0]
    assert second.logprobs == [0.0] * 6
    assert ledger.stats().branches == 1 and ledger.stats().drift_tokens == 2  # 11 and 12 were not sent back
    assert ledger.trained_branches() == [first]  # the new branch has sampled nothing of its own yet
    ledger.completion(second, [7], [-0.7], "1")
    assert ledger.trained_branches() == [first, second]
    assert first.turn_numbers == [0] and second.turn_numbers == [1]
    trained = [t for b in ledger.branches for t, m in zip(b.token_ids, b.loss_mask, strict=True) if m]
    assert sorted(trained) == [7, 10, 11, 12]  # every sampled token once
    # a later turn that extends the first branch still goes to it
    assert ledger.prompt([1, 2, 3, 10, 11, 12, 5]) is first


def test_forks_from_equally_shared_branches_take_the_first() -> None:
    """Two branches sharing as much with a new rendering (each turn's reply dropped from the next request, as
    mini-swe-agent does with a malformed reply): the fork comes from the first of them."""
    ledger = Ledger()
    for reply in ([10], [11], [12]):
        ledger.completion(ledger.prompt([1, 2]), reply, [-0.1], "0")  # the same prompt each time: a fork each time
    assert ledger.stats().branches == 2 and ledger.stats().drift_tokens == 2
    assert [b.token_ids for b in ledger.branches] == [[1, 2, 10], [1, 2, 11], [1, 2, 12]]


def test_a_completion_needs_one_logprob_per_token() -> None:
    ledger = Ledger()
    with pytest.raises(ValueError, match="2 output ids but 1 logprobs"):
        ledger.completion(ledger.prompt([1]), [2, 3], [-1.0], "")


def test_qwen3_tool_calls_are_parsed_and_the_rest_of_the_text_kept() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["bash"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"command": "ls -la"} and calls[0]["type"] == "function"
    broken = "<tool_call>{not json}</tool_call> and text"
    assert parse_tool_calls(broken) == (broken, [])  # not a call: left in the text


def test_requests_decode_leniently_and_tool_history_renders_with_objects() -> None:
    body = msgspec.json.decode(json.dumps({
        "model": "m", "unknown_key": 1, "max_completion_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"x": 1}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "out"}]}), type=ChatCompletionRequest)
    rendered = template_messages(body)
    assert rendered[0] == {"role": "user", "content": "ab"}
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert rendered[2] == {"role": "tool", "content": "out", "tool_call_id": "c1"}


def test_a_streamed_answer_carries_the_same_content_calls_and_usage() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]
    body = completion_body(model="m", content="hi", tool_calls=calls, finish_reason="tool_calls", prompt_tokens=3,
                           completion_tokens=2, request_id="chatcmpl-1")
    events = completion_chunks(body)
    assert events[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "hi"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and chunks[-1]["usage"]["total_tokens"] == 5
    assert [c["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] for c in chunks
            if "tool_calls" in c["choices"][0]["delta"]] == ["bash"]
