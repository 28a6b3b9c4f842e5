"""Head+tail context management keeps system + problem, early and late turns, within budget."""

from __future__ import annotations

from swectl.agent.context import fit_context
from swectl.agent.trajectory import Message


def count(messages: list[Message]) -> int:
    return sum(len(m.content.split()) + 4 for m in messages)


def conversation(turns: int) -> list[Message]:
    out = [Message("system", "sys " * 20), Message("user", "problem " * 50)]
    for i in range(turns):
        out += [Message("assistant", f"turn{i} " + "think " * 30), Message("user", f"obs{i} " + "out " * 60)]
    return out


def test_fits_untouched_when_small() -> None:
    msgs = conversation(2)
    assert fit_context(msgs, count, 10_000) == (msgs, 0)


def test_head_and_tail_within_budget() -> None:
    msgs = conversation(40)
    for budget in (600, 1000, 2500):
        kept, omitted = fit_context(msgs, count, budget)
        assert count(kept) <= budget
        assert kept[:2] == msgs[:2]
        assert omitted > 0
        marker = [m for m in kept if "omitted" in m.content]
        assert len(marker) == 1
        assert f"{omitted} earlier turn" in marker[0].content
        # The latest turn is always kept, and turns stay whole (assistant followed by its observation).
        assert kept[-2:] == msgs[-2:]
        roles = [m.role for m in kept[2:] if "omitted" not in m.content]
        assert roles == ["assistant", "user"] * (len(roles) // 2)
    kept, _ = fit_context(msgs, count, 2500)
    head = kept[2 : kept.index(next(m for m in kept if "omitted" in m.content))]
    assert head
    assert head[0] == msgs[2]  # the earliest turns are there too
    tail_tokens = count(kept[kept.index(next(m for m in kept if "omitted" in m.content)) + 1 :])
    assert tail_tokens > 2 * count(head)  # about 70 / 30


def test_problem_alone_too_big_is_returned_as_is() -> None:
    msgs = conversation(3)
    kept, omitted = fit_context(msgs, count, 50)
    assert kept[:2] == msgs[:2]
    assert count(kept) > 50
    assert omitted == 3


def test_episode_with_managed_context_stays_in_budget(tiny_tokenizer) -> None:
    """A long episode (fake sandbox, replay engine, real tokenizer) never sends more than the budget, and
    records one sample per step with exactly the prompt the engine saw."""
    import anyio

    from swectl.agent.loop import EpisodeConfig, run_episode
    from swectl.agent.protocol import AgentLimits
    from swectl.engine.wire import SamplingParams
    from swectl.schema import ExecResult
    from swectl.tasks.record import Task
    from swectl.testing.replay import ReplayEngine

    tok = tiny_tokenizer
    seen: list[int] = []

    class Engine(ReplayEngine):
        async def generate(self, request):
            seen.append(len(request.input_ids))
            return await super().generate(request)

    class Box:
        async def exec(self, command, timeout, *, cwd=None, env=None):
            return ExecResult(output="file.py\n" * 40, exit_code=0, timed_out=False)

        async def diff(self, repo=None):
            return b""

    replies = [f"THOUGHT: step {i}\n```bash\nls -la\n```" for i in range(30)]
    task = Task(instance_id="t", repo="r/r", problem_statement="fix it", FAIL_TO_PASS=["x"])
    ep_cfg = EpisodeConfig(limits=AgentLimits(step_limit=30, max_context_tokens=1500), manage_context=True,
                           sampling=SamplingParams(max_new_tokens=64))
    ep = anyio.run(run_episode, task, Box(), Engine(replies, tok), tok, ep_cfg)
    assert ep.exit_status == "LimitsExceeded"
    assert len(ep.steps) == 30
    assert max(seen) + 64 <= 1500
    assert len(ep.samples) == 30
    assert [len(s.prompt_ids) for s in ep.samples] == seen
    assert ep.samples[-1].omitted_turns > 0
    assert ep.samples[0].omitted_turns == 0
