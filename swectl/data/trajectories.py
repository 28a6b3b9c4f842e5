"""Trajectories -> ``TrainSample``s for supervised fine-tuning (swectl.rl.batch).

Two readers:

- ``samples_from_runs(paths)``: swectl's own episodes (``traj.json`` from a ``swectl eval --model`` or
  ``swectl data gold`` run folder). The tokens, loss mask and logprobs are the trajectory's own (token-in,
  token-out: exactly what the engine saw and emitted). ``resolved_only=True`` keeps the episodes whose
  ``meta.json`` says they resolved (rejection-sampling fine-tuning). An episode recorded per step (context
  management) gives one sample per step: prompt mask 0, output mask 1.
- ``samples_from_messages_jsonl(path, tokenizer)``: OpenAI-messages JSONL as SWE-smith's and SWE-Gym's published
  trajectories use (``{"messages": [{"role", "content"}, ...]}`` per line; content a string or a list of
  ``{"type": "text", "text": ...}`` parts). The conversation is rendered with the model's chat template; the
  loss mask is 1 on the tokens each assistant message adds (found by rendering prefixes), up to and including
  the end-of-turn token, and 0 elsewhere. Bad rows are reported as ``file:line: field: problem`` and skipped
  (a warning with the count) or, with ``strict=True``, fatal (a TaskDataError).

Every sample gets advantage 1.0 (SFT: each mask-1 token is trained with weight 1). ``reward`` is 1.0, except
for a swectl episode whose meta.json says it did not resolve (0.0).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from swectl.agent.loop import FORMAT_VERSION, Episode
from swectl.agent.scripted import end_of_turn_id
from swectl.errors import TaskDataError
from swectl.rl.batch import TrainSample, pack_sample
from swectl.rl.groups import mask_turns, span_turns
from swectl.tasks.sources import RowProblem, RowProblemError, jsonl_lines

_log = logging.getLogger(__name__)

TRAJ_FILE = "traj.json"
META_FILE = "meta.json"
ROLES = ("system", "user", "assistant", "tool")
SHOWN_PROBLEMS = 10


class _TrajFile(msgspec.Struct):
    """The parts of a traj.json this reader needs (the Rollout actor writes it)."""

    format_version: int
    episode: Episode


class EpisodeMeta(msgspec.Struct):
    """The parts of an episode's meta.json (the Rollout actor writes it) that the readers of episodes need."""

    instance_id: str = ""
    sample: int = 0
    resolved: bool = False


# ---------------------------------------------------------------------------------------------- swectl episodes


def trajectory_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The traj.json files that ``paths`` name: a traj.json itself, an episode folder holding one, or a run
    folder whose episode folders hold them (sorted). A path that holds none is a TaskDataError."""
    found: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_file():
            found.append(path)
        elif (path / TRAJ_FILE).is_file():
            found.append(path / TRAJ_FILE)
        elif path.is_dir():
            inside = sorted(path.glob(f"*/{TRAJ_FILE}"))
            if not inside:
                raise TaskDataError(f"{path}: no {TRAJ_FILE} in it or in its episode folders (<instance_id>__<n>/); "
                                    "give a run folder of `swectl eval --model` or `swectl data gold`")
            found += inside
        else:
            raise TaskDataError(f"{path}: no such file or folder")
    return found


def samples_from_runs(paths: Iterable[str | os.PathLike[str]], *, resolved_only: bool = False) -> list[TrainSample]:
    """TrainSamples from swectl episodes (traj.json files, episode folders or run folders). ABORTED episodes and
    episodes without token ids (chat-endpoint runs) are skipped with a warning; ``resolved_only`` keeps only the
    episodes whose meta.json says resolved (a missing meta.json is then a TaskDataError)."""
    samples: list[TrainSample] = []
    skipped: dict[str, int] = {}
    for path in trajectory_files(paths):
        episode = read_episode(path)
        meta = read_meta(path.parent / META_FILE, required_by="resolved_only" if resolved_only else "")
        if resolved_only and not (meta and meta.resolved):
            skipped["not resolved"] = skipped.get("not resolved", 0) + 1
            continue
        if episode.outcome == "ABORTED":
            skipped["aborted"] = skipped.get("aborted", 0) + 1
            continue
        if not episode.trajectory.token_ids and not episode.samples:
            skipped["no token ids (a chat-endpoint episode)"] = skipped.get(
                "no token ids (a chat-endpoint episode)", 0) + 1
            continue
        samples += _episode_samples(path, episode, meta)
    if skipped:
        _log.warning("skipped %s", ", ".join(f"{n} episodes: {why}" for why, n in skipped.items()))
    return samples


def read_episode(path: Path) -> Episode:
    """The Episode of a traj.json; a TaskDataError (naming the file) when it cannot be read, is not JSON, has
    another format_version or is not a swectl trajectory."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TaskDataError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        version = msgspec.json.decode(data, type=dict[str, Any]).get("format_version")
    except msgspec.DecodeError as exc:
        raise TaskDataError(f"{path}: not JSON ({exc})") from exc
    if version != FORMAT_VERSION:
        raise TaskDataError(f"{path}: format_version {version!r}; this swectl reads version {FORMAT_VERSION}")
    try:
        return msgspec.json.decode(data, type=_TrajFile).episode
    except msgspec.ValidationError as exc:
        raise TaskDataError(f"{path}: not a swectl trajectory: {exc}") from exc


def read_meta(path: Path, *, required_by: str = "") -> EpisodeMeta | None:
    """An episode's meta.json; None when it is missing, unless ``required_by`` names what needs it (then a
    TaskDataError, as for a file that is not an episode's meta.json)."""
    if not path.is_file():
        if required_by:
            raise TaskDataError(f"{path}: missing; {required_by} needs the episode's meta.json (its grade)")
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=EpisodeMeta)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TaskDataError(f"{path}: not an episode's meta.json: {exc}") from exc


def _episode_samples(path: Path, episode: Episode, meta: EpisodeMeta | None) -> list[TrainSample]:
    """One sample per episode (or per step, when the episode recorded them). A reply the agent loop rejected as
    malformed (no single bash block: ``Step.format_error``) carries no loss: SFT learns what came after a slip
    (the recovery), never the slip itself."""
    sample = meta.sample if meta else _sample_number(path.parent.name)
    malformed = [s.step for s in episode.steps if s.format_error]
    uid = f"{episode.instance_id}#{sample}"
    fields = {"advantage": 1.0, "reward": 0.0 if meta and not meta.resolved else 1.0,
              "truncated": episode.outcome == "TRUNCATED"}
    if episode.samples:  # the single stream is not what the model saw: one sample per step
        return [pack_sample(f"{uid}.{s.step}", episode.instance_id, [*s.prompt_ids, *s.output_ids],
                            [0] * len(s.prompt_ids) + [0 if s.step in malformed else 1] * len(s.output_ids),
                            [0.0] * len(s.prompt_ids) + list(s.output_logprobs),
                            weight_version=_version([s.weight_version]), **fields)
                for s in episode.samples]
    out = []
    for k, t in enumerate([episode.trajectory, *episode.branches]):  # an external harness's branches: a sample each
        # swectl's loop: span i is turn i (a malformed turn without a span is a broken file); a branch: its own turns
        try:
            spans = ([i for i, turn in enumerate(span_turns(t.loss_mask, t.turns)) if turn in malformed] if t.turns
                     else malformed)
            mask = mask_turns(t.loss_mask, spans)
            out.append(pack_sample(f"{uid}.b{k}" if k else uid, episode.instance_id, t.token_ids, mask, t.logprobs,
                                   weight_version=_version(t.weight_versions), **fields))
        except ValueError as exc:
            raise TaskDataError(f"{path}: {exc}") from exc
    return out


def _sample_number(folder: str) -> int:
    tail = folder.rsplit("__", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _version(versions: Sequence[str]) -> int:
    """TrainSample.weight_version: the oldest numeric engine version of the episode, 0 when none is numeric
    (``"gold"``, ``""``)."""
    numeric = [int(v) for v in versions if v.isdigit()]
    return min(numeric) if numeric else 0


# ---------------------------------------------------------------------------------------------- messages JSONL


def samples_from_messages_jsonl(path: str | os.PathLike[str], tokenizer: Any, *,
                                strict: bool = False) -> list[TrainSample]:
    """TrainSamples from an OpenAI-messages JSONL file (``.jsonl`` or ``.jsonl.gz``), one per good row, tokenized
    with ``tokenizer``'s chat template; mask 1 on the assistant turns (with their end-of-turn token). Bad rows
    are skipped with a warning (``file:line: field: problem``), or raise a RowProblemError (a TaskDataError)
    with ``strict``."""
    source = Path(path)
    eot = end_of_turn_id(tokenizer)
    samples: list[TrainSample] = []
    problems: list[RowProblem] = []
    for location, number, row in jsonl_lines(source):
        try:
            if isinstance(row, RowProblem):
                raise RowProblemError(row)
            conversation = _conversation(row, location)
            samples.append(conversation_sample(conversation, tokenizer, eot, _uid(row, source, number),
                                                location))
        except RowProblemError as exc:
            if strict:
                raise RowProblemError(exc.problem, "fix the row, or read without strict to skip bad rows") from None
            problems.append(exc.problem)
    if problems:
        shown = "\n  ".join(str(p) for p in problems[:SHOWN_PROBLEMS])
        more = f"\n  ... and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
        _log.warning("%s: skipped %d bad rows of %d:\n  %s%s", source, len(problems),
                     len(problems) + len(samples), shown, more)
    return samples


def _conversation(row: Any, location: str) -> list[dict[str, str]]:
    """The row's messages as ``{"role", "content"}`` with text content; RowProblemError naming the field."""

    def bad(field: str, message: str) -> RowProblemError:
        return RowProblemError(RowProblem(location, field, message))

    if not isinstance(row, dict):
        raise bad("row", f"expected a JSON object, got {type(row).__name__}")
    messages = row.get("messages")
    if messages is None:
        raise bad("messages", "missing (expected a list of {role, content} messages)")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty list of {role, content} messages")
    out = []
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(field, f"expected an object with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{field}.role", f"{role!r}: expected one of {', '.join(ROLES)}")
        if message.get("tool_calls"):
            raise bad(f"{field}.tool_calls", "tool calls are not supported (only text turns)")
        content = _text(message.get("content"), f"{field}.content", bad)
        if not content.strip():
            raise bad(f"{field}.content", "empty")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise bad("messages", "no assistant message: nothing to learn from")
    return out


def _text(content: Any, field: str, bad: Any) -> str:
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        pieces = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{field}[{j}]", 'expected a {"type": "text", "text": "..."} part')
            pieces.append(part["text"])
        text = "".join(pieces)
    elif content is None:
        raise bad(field, "missing")
    else:
        raise bad(field, f"expected a string or a list of text parts, got {type(content).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(field, "not valid Unicode (a lone surrogate escape)") from None
    return text


def _uid(row: dict[str, Any], source: Path, number: int) -> str:
    name = row.get("instance_id") or row.get("traj_id") or source.name
    return f"{name}#{number}" if isinstance(name, str) and name else f"{source.name}#{number}"


def _render(tokenizer: Any, conversation: list[dict[str, str]], *, generation_prompt: bool) -> list[int]:
    rendered = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=generation_prompt)
    ids = rendered if isinstance(rendered, list) else rendered["input_ids"]
    return [int(t) for t in ids]


def _render_text(tokenizer: Any, conversation: list[dict[str, str]], *, generation_prompt: bool) -> str:
    if not conversation:
        return ""
    return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The length of the longest common prefix (C-speed slice comparisons, binary search when not a prefix)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


def conversation_sample(conversation: list[dict[str, str]], tokenizer: Any, eot: int, uid: str,
                        location: str, *, skip: frozenset[int] | set[int] = frozenset()) -> TrainSample:
    """The tokens of the whole conversation as the chat template renders them, mask 1 on what a model emits for
    each assistant message (but those whose index is in ``skip``): its tokens up to and including the first
    end-of-turn token, not what the template adds after it (ChatML's newline), which the model never emits."""
    ids = _render(tokenizer, conversation, generation_prompt=False)
    mask = _mask_by_text(conversation, tokenizer, eot, ids, skip)
    if mask is None:
        mask = _mask_by_tokens(conversation, tokenizer, eot, ids, location, skip)
    group = uid.rsplit("#", 1)[0]
    return pack_sample(uid, group, ids, mask, [0.0] * len(ids), advantage=1.0, reward=1.0)


def _mask_by_text(conversation: list[dict[str, str]], tokenizer: Any, eot: int, ids: list[int],
                  skip: frozenset[int] | set[int] = frozenset()) -> list[int] | None:
    """The fast way (one rendering per prefix as text, one tokenization of the whole): each assistant turn's text
    starts where the text of the conversation before it (with the generation prompt) stops matching and ends where
    the text up to it does; the pieces between those bounds are tokenized one by one. None when the pieces'
    tokens are not the whole conversation's (a BPE merge across a bound): then the prefixes are tokenized."""
    text = _render_text(tokenizer, conversation, generation_prompt=False)
    bounds = []
    for i, message in enumerate(conversation):
        if message["role"] == "assistant" and i not in skip:
            start = _common_prefix(text, _render_text(tokenizer, conversation[:i], generation_prompt=True))
            end = _common_prefix(text, _render_text(tokenizer, conversation[: i + 1], generation_prompt=False))
            if end <= start:
                return None
            bounds.append((start, end))
    pieces: list[int] = []
    mask: list[int] = []
    done = 0
    for start, end in bounds:
        before = tokenizer.encode(text[done:start], add_special_tokens=False) if start > done else []
        turn = tokenizer.encode(text[start:end], add_special_tokens=False)
        emitted = turn.index(eot) + 1 if eot in turn else len(turn)
        pieces += [*before, *turn]
        mask += [0] * len(before) + [1] * emitted + [0] * (len(turn) - emitted)
        done = end
    rest = tokenizer.encode(text[done:], add_special_tokens=False) if done < len(text) else []
    pieces += rest
    mask += [0] * len(rest)
    return mask if [int(t) for t in pieces] == ids else None


def _mask_by_tokens(conversation: list[dict[str, str]], tokenizer: Any, eot: int, ids: list[int],
                    location: str, skip: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """The exact way: each assistant turn starts where the tokens of the conversation before it (with the
    generation prompt) stop matching, and ends at its first end-of-turn token (else where the tokens up to it
    stop matching)."""
    mask = [0] * len(ids)
    for i, message in enumerate(conversation):
        if message["role"] != "assistant" or i in skip:
            continue
        start = _common_prefix(ids, _render(tokenizer, conversation[:i], generation_prompt=True)) if i else 0
        end = _common_prefix(ids, _render(tokenizer, conversation[: i + 1], generation_prompt=False))
        if eot in ids[start:end]:
            end = ids.index(eot, start, end) + 1
        if end <= start:
            raise RowProblemError(RowProblem(location, f"messages[{i}]", "the chat template renders this assistant "
                                             "message as no tokens"))
        mask[start:end] = [1] * (end - start)
    return mask
