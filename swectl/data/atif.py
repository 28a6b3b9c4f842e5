"""ATIF (Harbor's Agent Trajectory Interchange Format, v1.7): swectl's episodes out, other tools' trajectories in.

Out: ``episode_to_atif`` turns one swectl episode (a traj.json: its own agent loop, or an external harness's episode
recorded by the gateway) into an ATIF document. The system prompt and the task are ``system`` and ``user`` steps; each
model turn is an ``agent`` step with its text, its bash command as a tool call, the observation that answered it, and
token-exact metrics: ``prompt_token_ids`` (every token the engine was given for that call), ``completion_token_ids``
and ``logprobs`` (what it emitted). What ATIF has no field for rides in ``extra``: per step the weight version and the
loss mask of the completion (0 on a reply the loop rejected as malformed); per document the instance id, how the
episode ended, its patch and grade. An external harness's other branches are embedded subagent trajectories.

In: ``read_atif`` decodes any ATIF document (v1.0 to v1.8, unknown fields kept out of the way) into typed structs;
``samples_from_atif`` makes SFT samples of them: token-exact where the steps carry token ids (a step whose prompt
extends the previous call's prompt and completion continues one sample; otherwise a new one starts), rendered with
the model's chat template where they do not. A step marked ``is_copied_context`` is never trained (mask 0).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from swectl import __version__
from swectl.agent.loop import Episode
from swectl.agent.trajectory import Trajectory
from swectl.errors import TaskDataError
from swectl.rl.batch import TrainSample, pack_sample
from swectl.rl.groups import span_turns

_log = logging.getLogger(__name__)

SCHEMA_VERSION = "ATIF-v1.7"
READABLE_VERSIONS = tuple(f"ATIF-v1.{n}" for n in range(9))
AGENT_NAME = "swectl"
BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Run one bash command in the task's sandbox; its output is the observation.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
ATIF_SUFFIX = ".atif.json"


class AtifAgent(msgspec.Struct, kw_only=True, omit_defaults=True):
    """ATIF's agent: who produced the trajectory (name, version, model, tool definitions)."""
    name: str
    version: str
    model_name: str | None = None
    tool_definitions: list[dict[str, Any]] | None = None
    extra: dict[str, Any] | None = None


class AtifToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One tool call of an agent step (its id, function name and arguments)."""
    tool_call_id: str
    function_name: str
    arguments: dict[str, Any]
    extra: dict[str, Any] | None = None


class AtifObservationResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One result in an observation (the output of a tool call, by its call id)."""
    source_call_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    extra: dict[str, Any] | None = None


class AtifObservation(msgspec.Struct, kw_only=True):
    """What the environment answered to an agent step."""
    results: list[AtifObservationResult]


class AtifMetrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One model call's metrics: token counts, and the token ids and logprobs that make RL data of it."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cost_usd: float | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    extra: dict[str, Any] | None = None


class AtifStep(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One step: a system, user or agent message, with an agent step's tool calls, observation and metrics."""
    step_id: int
    source: Literal["system", "user", "agent"]
    message: str | list[dict[str, Any]]
    timestamp: str | None = None
    model_name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[AtifToolCall] | None = None
    observation: AtifObservation | None = None
    metrics: AtifMetrics | None = None
    is_copied_context: bool | None = None
    extra: dict[str, Any] | None = None


class AtifFinalMetrics(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Totals over the trajectory."""
    total_prompt_tokens: int | None = None
    total_completion_tokens: int | None = None
    total_steps: int | None = None
    extra: dict[str, Any] | None = None


class AtifTrajectory(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An ATIF document (v1.0 to v1.8 read; v1.7 written)."""
    schema_version: str
    agent: AtifAgent
    steps: list[AtifStep]
    session_id: str | None = None
    trajectory_id: str | None = None
    notes: str | None = None
    final_metrics: AtifFinalMetrics | None = None
    extra: dict[str, Any] | None = None
    subagent_trajectories: list[AtifTrajectory] | None = None


# ---------------------------------------------------------------------------------------------- swectl -> ATIF


def _spans(mask: Sequence[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of 1 in a loss mask: one per model turn."""
    spans, start = [], None
    for i, bit in enumerate(mask):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(mask)))
    return spans


def _text_steps(messages: Sequence[Any]) -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """(source, text) of the messages before the first model turn; each model turn's text; the observation after
    each model turn ('' when none came)."""
    head: list[tuple[str, str]] = []
    replies: list[str] = []
    observations: list[str] = []
    for m in messages:
        if m.role == "assistant":
            replies.append(m.content)
            observations.append("")
        elif not replies:
            head.append(("system" if m.role == "system" else "user", m.content))
        else:
            observations[-1] += m.content
    return head, replies, observations


def _agent_step(step_id: int, k: int, text: str, action: str, observation: str, prompt: list[int],
                completion: list[int], logprobs: list[float], trained: int, extra: dict[str, Any],
                model_name: str | None) -> AtifStep:
    """Model turn ``k`` as an agent step: its text, its bash command as a tool call, the observation that answered
    it, the call's token ids and logprobs, and the completion's loss mask (``trained`` on every token)."""
    call_id = f"call_{k + 1}"
    tool_calls = ([AtifToolCall(tool_call_id=call_id, function_name="bash", arguments={"command": action})]
                  if action else None)
    return AtifStep(
        step_id=step_id, source="agent", message=text, model_name=model_name, tool_calls=tool_calls,
        observation=AtifObservation(results=[AtifObservationResult(
            source_call_id=call_id if tool_calls else None, content=observation)]) if observation else None,
        metrics=AtifMetrics(prompt_tokens=len(prompt), completion_tokens=len(completion), prompt_token_ids=prompt,
                            completion_token_ids=completion, logprobs=logprobs,
                            extra={"loss_mask": [trained] * len(completion)}),
        extra={"swectl": extra})


def _trajectory_doc(t: Trajectory, episode: Episode, *, model_name: str | None, trajectory_id: str | None,
                    session_id: str, decode: Any) -> AtifTrajectory:
    head, replies, observations = _text_steps(t.messages)
    steps: list[AtifStep] = [AtifStep(step_id=i + 1, source=source, message=text)
                             for i, (source, text) in enumerate(head)]
    if not steps:  # ATIF needs at least one step; a harness episode recorded by tokens only starts with its prompt
        steps.append(AtifStep(step_id=1, source="user", message=decode(t.token_ids[:t.prompt_length])
                              if decode and t.prompt_length else "",
                              extra={"swectl": {"note": "the prompt of a harness episode, decoded from its tokens"}}))
    spans = _spans(t.loss_mask)
    turns = span_turns(t.loss_mask, t.turns) if t.turns else list(range(len(spans)))
    malformed = {s.step for s in episode.steps if s.format_error}
    for k, (start, end) in enumerate(spans):
        turn = turns[k] if k < len(turns) else k
        own_loop = not t.turns and turn < len(episode.steps)
        step = episode.steps[turn] if own_loop else None
        text = replies[k] if k < len(replies) else (decode(t.token_ids[start:end]) if decode else "")
        observation = observations[k] if k < len(observations) else ""
        trained = 0 if turn in malformed else 1  # a reply the loop (or the harness) rejected: never trained
        version = t.weight_versions[k] if k < len(t.weight_versions) else ""
        step_extra: dict[str, Any] = {"weight_version": version, "turn": turn}
        if step is not None:
            step_extra |= {"format_error": step.format_error, "returncode": step.returncode,
                           "timed_out": step.timed_out, "model_time_s": step.model_time_s,
                           "env_time_s": step.env_time_s}
        steps.append(_agent_step(len(steps) + 1, k, text, step.action if step is not None else "", observation,
                                 t.token_ids[:start], t.token_ids[start:end], t.logprobs[start:end], trained,
                                 step_extra, model_name))
    return AtifTrajectory(
        schema_version=SCHEMA_VERSION, session_id=session_id, trajectory_id=trajectory_id,
        agent=AtifAgent(name=AGENT_NAME, version=__version__, model_name=model_name, tool_definitions=[BASH_TOOL]),
        steps=steps,
        final_metrics=AtifFinalMetrics(
            total_prompt_tokens=sum(s.metrics.prompt_tokens or 0 for s in steps if s.metrics),
            total_completion_tokens=sum(s.metrics.completion_tokens or 0 for s in steps if s.metrics),
            total_steps=len(steps)),
        extra={"swectl": {"realignments": t.realignments}} if t.realignments else None)


def _per_step_doc(episode: Episode, *, model_name: str | None, session_id: str) -> AtifTrajectory:
    """An episode recorded per step (context management): each call's own prompt, as the engine saw it."""
    head, replies, observations = _text_steps(episode.trajectory.messages)
    steps = [AtifStep(step_id=i + 1, source=source, message=text) for i, (source, text) in enumerate(head)]
    malformed = {s.step for s in episode.steps if s.format_error}
    for s in episode.samples:
        k = s.step
        observation = observations[k] if k < len(observations) else ""
        action = episode.steps[k].action if k < len(episode.steps) else ""
        steps.append(_agent_step(len(steps) + 1, k, replies[k] if k < len(replies) else "", action, observation,
                                 list(s.prompt_ids), list(s.output_ids), list(s.output_logprobs),
                                 0 if k in malformed else 1,
                                 {"weight_version": s.weight_version, "turn": k, "omitted_turns": s.omitted_turns},
                                 model_name))
    if not steps:
        steps.append(AtifStep(step_id=1, source="user", message=""))
    return AtifTrajectory(schema_version=SCHEMA_VERSION, session_id=session_id,
                          agent=AtifAgent(name=AGENT_NAME, version=__version__, model_name=model_name,
                                          tool_definitions=[BASH_TOOL]), steps=steps,
                          final_metrics=AtifFinalMetrics(total_steps=len(steps)))


def episode_to_atif(episode: Episode, *, session_id: str, meta: dict[str, Any] | None = None,
                    model_name: str | None = None, decode: Any = None) -> AtifTrajectory:
    """One swectl episode as an ATIF document. ``meta`` (the episode's meta.json) adds its grade; ``decode`` (a
    tokenizer's ``decode``) gives text to turns recorded by tokens only (an external harness's)."""
    if episode.samples:
        doc = _per_step_doc(episode, model_name=model_name, session_id=session_id)
    else:
        doc = _trajectory_doc(episode.trajectory, episode, model_name=model_name, trajectory_id=None,
                              session_id=session_id, decode=decode)
    if episode.branches:
        doc.subagent_trajectories = [
            _trajectory_doc(b, episode, model_name=model_name, trajectory_id=f"{session_id}.branch{k + 1}",
                            session_id=session_id, decode=decode) for k, b in enumerate(episode.branches)]
    grade = (meta or {}).get("grade") or {}
    doc.extra = {**(doc.extra or {}), "swectl": {
        **((doc.extra or {}).get("swectl") or {}),
        "instance_id": episode.instance_id, "exit_status": episode.exit_status, "outcome": episode.outcome,
        "reason": episode.reason, "patch": episode.patch, "submitted": episode.submitted,
        "resolved": bool((meta or {}).get("resolved", False)), "grade": grade.get("status", ""),
        "sample": (meta or {}).get("sample", 0), "total_time_s": episode.total_time_s}}
    return doc


def encode(doc: AtifTrajectory) -> bytes:
    return msgspec.json.format(msgspec.json.encode(doc), indent=2)


def export_runs(paths: Iterable[str | os.PathLike[str]], out: Path, *, model_name: str | None = None,
                decode: Any = None) -> list[Path]:
    """Every episode (traj.json) that ``paths`` name written to ``out`` as ``<episode folder>.atif.json``."""
    from swectl.data.trajectories import META_FILE, read_episode, trajectory_files
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for traj in trajectory_files(paths):
        episode = read_episode(traj)
        try:
            meta = json.loads((traj.parent / META_FILE).read_text())
        except (OSError, ValueError):
            meta = None
        name = traj.parent.name if traj.parent.name else episode.instance_id
        doc = episode_to_atif(episode, session_id=name, meta=meta if isinstance(meta, dict) else None,
                              model_name=model_name, decode=decode)
        target = out / f"{name}{ATIF_SUFFIX}"
        target.write_bytes(encode(doc))
        written.append(target)
    return written


# ---------------------------------------------------------------------------------------------- ATIF -> swectl


def read_atif(path: Path) -> AtifTrajectory:
    """An ATIF document; a TaskDataError naming the file and the field when it is not one."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TaskDataError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        head = msgspec.json.decode(data, type=dict[str, Any])
    except msgspec.DecodeError as exc:
        raise TaskDataError(f"{path}: not JSON ({exc})") from exc
    version = head.get("schema_version")
    if version not in READABLE_VERSIONS:
        raise TaskDataError(f"{path}: schema_version {version!r} is not an ATIF version swectl reads "
                            f"({READABLE_VERSIONS[0]} to {READABLE_VERSIONS[-1]})")
    try:
        return msgspec.json.decode(data, type=AtifTrajectory)
    except msgspec.ValidationError as exc:
        raise TaskDataError(f"{path}: not an ATIF trajectory: {exc}") from exc


def is_atif(path: Path) -> bool:
    """Whether a .json file is an ATIF document (its schema_version says so; read cheaply from the first KiB)."""
    if path.suffix != ".json" or not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            start = f.read(4096)
    except OSError:
        return False
    return b'"schema_version"' in start and b'"ATIF-v1.' in start


def atif_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The ATIF files ``paths`` name: files themselves, or the ATIF files anywhere under a folder (a Harbor job
    folder keeps them at ``<trial>/agent/trajectory.json``). A path holding none is a TaskDataError."""
    found: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            inside = sorted(p for p in path.rglob("*.json") if is_atif(p))
            if not inside:
                raise TaskDataError(f"{path}: no ATIF trajectory (.json with an ATIF schema_version) under it")
            found += inside
        else:
            raise TaskDataError(f"{path}: no such file or folder")
    return found


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def conversation_of(doc: AtifTrajectory) -> list[tuple[dict[str, str], bool]]:
    """The document as chat messages, each with whether it is trained (an agent step not copied context):
    system and user steps as themselves, an agent step as the assistant (its tool calls as text when it has no
    text), its observation as the next user message."""
    out: list[tuple[dict[str, str], bool]] = []
    for step in doc.steps:
        text = _text_of(step.message)
        if step.source == "agent":
            if not text and step.tool_calls:
                text = "\n".join(json.dumps({"name": c.function_name, "arguments": c.arguments})
                                 for c in step.tool_calls)
            out.append(({"role": "assistant", "content": text}, not step.is_copied_context))
            if step.observation is not None:
                seen = "\n".join(_text_of(r.content) for r in step.observation.results)
                if seen:
                    out.append(({"role": "user", "content": seen}, False))
        else:
            out.append(({"role": step.source, "content": text}, False))
    return out


def _token_samples(doc: AtifTrajectory, uid: str, group: str, fields: dict[str, Any]) -> list[TrainSample] | None:
    """Token-exact samples when every model call in the document carries its prompt and completion ids (None
    otherwise): a call whose prompt extends the previous call's prompt + completion continues that sample."""
    calls = [s for s in doc.steps if s.source == "agent" and s.metrics is not None]
    if not calls or any(c.metrics.prompt_token_ids is None or c.metrics.completion_token_ids is None
                        for c in calls if c.metrics):
        return None
    chains: list[tuple[list[int], list[int], list[float]]] = []
    for c in calls:
        m = c.metrics
        assert m is not None and m.prompt_token_ids is not None and m.completion_token_ids is not None
        prompt, completion = list(m.prompt_token_ids), list(m.completion_token_ids)
        logprobs = list(m.logprobs) if m.logprobs is not None and len(m.logprobs) == len(completion) \
            else [0.0] * len(completion)
        trained = list((m.extra or {}).get("loss_mask") or [1] * len(completion))
        if len(trained) != len(completion):
            trained = [1] * len(completion)
        if c.is_copied_context:
            trained = [0] * len(completion)
        if chains and prompt[:len(chains[-1][0])] == chains[-1][0]:
            ids, mask, lps = chains[-1]
            grown = prompt[len(ids):]
            ids += grown + completion
            mask += [0] * len(grown) + trained
            lps += [0.0] * len(grown) + logprobs
        else:
            chains.append((prompt + completion, [0] * len(prompt) + trained, [0.0] * len(prompt) + logprobs))
    return [pack_sample(f"{uid}.{k}" if len(chains) > 1 else uid, group, ids, mask, lps, **fields)
            for k, (ids, mask, lps) in enumerate(chains)]


def samples_from_atif(paths: Iterable[str | os.PathLike[str]], tokenizer: Any = None) -> list[TrainSample]:
    """SFT samples from ATIF files (or folders holding them): token-exact from the steps' token ids where every
    model call has them, else rendered with ``tokenizer``'s chat template (needed then). Copied context is never
    trained; a document with nothing to train is skipped with a warning."""
    from swectl.agent.scripted import end_of_turn_id
    from swectl.data.trajectories import conversation_sample

    samples: list[TrainSample] = []
    empty = 0
    for path in atif_files(paths):
        doc = read_atif(path)
        ours = (doc.extra or {}).get("swectl") or {}  # a document swectl wrote: its episode's grade and ending
        group = str(ours.get("instance_id") or path.parent.name)
        base = f"{group}#{ours.get('sample', 0)}" if ours.get("instance_id") else f"{path.parent.name}/{path.name}"
        versions = [str(((st.extra or {}).get("swectl") or {}).get("weight_version", "")) for st in doc.steps]
        numeric = [int(v) for v in versions if v.isdigit()]
        fields = {"advantage": 1.0, "reward": 0.0 if ours and not ours.get("resolved") else 1.0,
                  "truncated": ours.get("outcome") == "TRUNCATED", "weight_version": min(numeric, default=0)}
        for k, part in enumerate([doc, *(doc.subagent_trajectories or [])]):
            uid = f"{base}.b{k}" if k else base
            got = _token_samples(part, uid, group, fields)
            if got is None:
                conversation = conversation_of(part)
                if not any(trained for _, trained in conversation):
                    empty += 1
                    continue
                if tokenizer is None:
                    raise TaskDataError(f"{path}: its steps carry no token ids; rendering them needs the model's "
                                        "tokenizer")
                skip = {i for i, (m, trained) in enumerate(conversation) if m["role"] == "assistant" and not trained}
                got = [msgspec.structs.replace(
                    conversation_sample([m for m, _ in conversation], tokenizer, end_of_turn_id(tokenizer), uid,
                                        str(path), skip=skip), reward=fields["reward"], truncated=fields["truncated"],
                    weight_version=fields["weight_version"])]
            if not got:
                empty += 1
            samples += got
    if empty:
        _log.warning("skipped %d ATIF trajectories with no trained step (only copied context or no agent step)",
                     empty)
    return samples
