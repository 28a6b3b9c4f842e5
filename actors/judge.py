"""The Judge actor: process rewards (``[reward.prm]``): each agent step judged by a judge model, ``samples`` times.

The prompt and the vote rules are swectl/rl/prm.py's; this actor renders the judge's chat with its tokenizer, sends
the requests (token-in/token-out, SGLang's API: an Engines group of its own or a running server), and turns the
answers into a StepJudgement. A request that fails (the server is down, a timeout, a rejection) is counted as a
failure and is never a vote; an answer without a parseable ``\\boxed{}`` is counted as unparseable. The judge never
holds an episode up: the Rollout starts ``judge()`` for a step as soon as the step is done and collects the
judgements after the episode (while it is graded).

Consumes: ``judge(key, problem, history, step)`` calls from the Rollout. Waits for: the judge's engine. Produces:
StepJudgements, ``statistics()`` (a JudgeStatistics). A plain object (it starts no task): its calls
run in the caller's tasks.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from swectl.agent.loop import Engine
from swectl.agent.trajectory import ChatTokenizer, rendered_ids
from swectl.config import PrmConfig
from swectl.engine.wire import GenerateRequest, SamplingParams
from swectl.errors import SwectlError
from swectl.rl.prm import StepJudgement, StepView, judge_messages, judgement
from swectl.schema import JudgeStatistics

EngineFor = Callable[[str], Engine]  # a session key -> the judge's engine for it


class Judge:
    """Judges agent steps with the judge model behind ``engine_for``; ``tokenizer`` is the judge's."""

    def __init__(self, config: PrmConfig, engine_for: EngineFor, tokenizer: ChatTokenizer) -> None:
        self._cfg = config
        self._engine_for = engine_for
        self._tok = tokenizer
        self._counts = dict.fromkeys(("steps", "scored", "votes", "unparseable", "failures"), 0)

    def statistics(self) -> JudgeStatistics:
        return JudgeStatistics(**self._counts)

    async def judge(self, key: str, problem: str, history: list[StepView], step: StepView) -> StepJudgement:
        """``samples`` answers on ``step`` of episode ``key`` (``<instance_id>#<sample>``), concurrently."""
        cfg = self._cfg
        messages = judge_messages(problem, history, step, history_steps=cfg.history_steps, max_chars=cfg.max_chars)
        rendered = self._tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = rendered_ids(rendered)
        sampling = SamplingParams(max_new_tokens=cfg.max_tokens, temperature=cfg.temperature)
        answers: list[str | None] = [None] * cfg.samples
        engine = self._engine_for(f"judge-{key}")

        async def ask(i: int) -> None:
            request = GenerateRequest(input_ids=ids, sampling_params=sampling, rid=f"judge-{key}.{step.step}/{i}")
            try:
                with anyio.fail_after(cfg.timeout_s):
                    result = await engine.generate(request)
            except (SwectlError, TimeoutError, OSError):
                return  # a failure: counted below, never a vote
            if result.finish_reason != "abort":
                answers[i] = self._tok.decode(result.output_ids, skip_special_tokens=True)

        async with anyio.create_task_group() as tg:
            for i in range(cfg.samples):
                tg.start_soon(ask, i)
        verdict = judgement(step.step, answers)
        c = self._counts
        c["steps"] += 1
        c["scored"] += verdict.score is not None
        c["votes"] += len(verdict.votes)
        c["unparseable"] += verdict.unparseable
        c["failures"] += verdict.failures
        return verdict
