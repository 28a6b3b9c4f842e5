"""The token record of one gateway session (one episode of an external harness): what the engine saw and sampled.

A harness sends its whole conversation each turn; the gateway renders it with the policy's chat template and the
ledger decides where that rendering goes:

- it **extends** a branch (the branch's tokens are a prefix of it): the new tokens are appended as prompt (loss 0),
  and the completion the engine samples is appended as output (loss 1, with its logprobs and weight version);
- it does **not** (a template that strips past reasoning, a harness that rewrote a tool call or trimmed its
  history): a new branch starts from the longest common prefix with the branches so far. The shared prefix is the
  new branch's context (loss 0: its sampled tokens are trained in the branch they were sampled in), the rest is
  prompt. ``drift_tokens`` counts the tokens of the old branch past the fork: tokens the engine sampled that the
  harness did not send back as they were.

Each branch becomes its own training sample, trained only on the tokens the engine sampled in that branch, so every
sampled token is trained exactly once, in the context it was sampled in. Every
branch of an episode gets the episode's reward: the reward judges the episode's final patch, which the whole
conversation produced, and a branch is the same conversation told with a different history, not another attempt
(docs/gateway.md).
"""

from __future__ import annotations

import msgspec


class Branch(msgspec.Struct, kw_only=True):
    """One token sequence of a session: ids, loss mask (1: sampled by the engine), logprobs (0.0 off the mask) and
    the weight version of each turn sampled in it."""

    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    weight_versions: list[str] = []
    turn_numbers: list[int] = []  # the session's turn number (0-based) of each completion sampled in this branch

    @property
    def turns(self) -> int:
        """Completions sampled in this branch."""
        return len(self.turn_numbers)

    def check(self) -> None:
        if not (len(self.token_ids) == len(self.loss_mask) == len(self.logprobs)):
            raise AssertionError("branch arrays differ in length")


class LedgerStats(msgspec.Struct, frozen=True, kw_only=True):
    """``gateway/branches`` (branches beyond the first) and ``gateway/drift_tokens`` of a session."""

    turns: int
    branches: int
    drift_tokens: int


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Ledger:
    """The branches of one session; ``prompt(ids)`` places a rendered prompt, ``completion(...)`` records what the
    engine sampled after it."""

    def __init__(self) -> None:
        self.branches: list[Branch] = []
        self._current: Branch | None = None
        self.drift_tokens = 0
        self.turns = 0

    def prompt(self, ids: list[int]) -> Branch:
        """The branch a rendered prompt ``ids`` continues (made when none does); its tokens are then ``ids``."""
        for branch in reversed(self.branches):
            n = len(branch.token_ids)
            if n <= len(ids) and branch.token_ids == ids[:n]:
                self._extend_prompt(branch, ids[n:])
                self._current = branch
                return branch
        if not self.branches:
            branch = Branch()
            self._extend_prompt(branch, ids)
        else:  # a fork: from the branch sharing the longest prefix with ``ids``
            source = max(self.branches, key=lambda b: _common_prefix(b.token_ids, ids))  # the first of equals
            shared = _common_prefix(source.token_ids, ids)
            self.drift_tokens += len(source.token_ids) - shared
            branch = Branch()
            self._extend_prompt(branch, ids)  # the shared prefix is context here: trained in ``source``
        self.branches.append(branch)
        self._current = branch
        return branch

    @staticmethod
    def _extend_prompt(branch: Branch, ids: list[int]) -> None:
        branch.token_ids += ids
        branch.loss_mask += [0] * len(ids)
        branch.logprobs += [0.0] * len(ids)

    def completion(self, branch: Branch, ids: list[int], logprobs: list[float], weight_version: str) -> None:
        """What the engine sampled after ``branch``'s prompt (one logprob per id)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} output ids but {len(logprobs)} logprobs")
        branch.token_ids += ids
        branch.loss_mask += [1] * len(ids)
        branch.logprobs += list(logprobs)
        branch.weight_versions.append(weight_version)
        branch.turn_numbers.append(self.turns)
        self.turns += 1
        branch.check()

    def stats(self) -> LedgerStats:
        return LedgerStats(turns=self.turns, branches=max(len(self.branches) - 1, 0), drift_tokens=self.drift_tokens)

    def trained_branches(self) -> list[Branch]:
        """The branches with at least one sampled turn (a branch with none has nothing to train on)."""
        return [b for b in self.branches if b.turns]
