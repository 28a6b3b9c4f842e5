"""What `swectl view` knows of a run folder: its curves, its episodes, one episode in full.

A run folder is a `swectl up` run (``metrics.jsonl``, ``steps.jsonl``, ``episodes/``, ``eval/``), a `swectl eval`
output (``results.jsonl``, ``<instance_id>__<n>/``), or a folder of ATIF trajectories written by any tool (a Harbor
job folder, `swectl data atif`'s output; one ATIF file alone too): each document is an episode, its reward the
verifier's from the Harbor trial's ``result.json`` where there is one. The index is built once and brought up to
date by ``refresh``: new lines of ``metrics.jsonl`` and ``steps.jsonl`` are read from where the last read stopped
(a partial last line waits for its end), and only episode folders not seen before are read (their ``meta.json``;
trajectories are read when an episode is opened, or asked for its weight version).
Nothing here writes to the run folder.

An episode's reward is not in its meta.json: the training loop records each step's group rewards in
``steps.jsonl`` (``{"step": N, "rewards": {instance_id: [one per scored episode, by sample]}}``), matched here to
the scored episodes (not ABORTED, no infrastructure failure) of ``episodes/step_N/`` in sample order. Episodes of
the async loop (``episodes/group_N/``), held-out readings and `swectl eval` outputs have no reward (None).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import msgspec

from swectl.data.atif import conversation_of, is_atif, read_atif
from swectl.errors import ConfigError, TaskDataError
from swectl.rl.groups import REWARDS_FILE

OBSERVATION_SHOWN_CHARS = 20_000  # a message longer than this is shown cut, with its full size
LOG_TAIL_CHARS = 20_000
_STEP_FOLDER = re.compile(r"^step_(\d+)$")
_GROUP_FOLDER = re.compile(r"^group_(\d+)$")


class EpisodeRow(msgspec.Struct, kw_only=True):
    """One episode in the run's list: where it is and how it ended."""

    id: str  # its folder, relative to the run folder
    phase: str  # "train" (a training step's or group's episodes), "eval" (held-out readings), "run" (swectl eval)
    step: int  # the training step (train), the step read after (eval), 0 for swectl eval
    instance_id: str
    sample: int
    exit_status: str = ""
    outcome: str = ""
    resolved: bool = False
    grade: str = ""  # the grade's status: resolved, unresolved, error, ... ("" when not graded)
    turns: int = 0
    total_time_s: float = 0.0
    scored: bool = True  # GRPO scores it: not ABORTED, no infrastructure failure in its grading
    reward: float | None = None  # from steps.jsonl (None: not recorded for it)
    weight_versions: list[str] | None = None  # the policy versions of its turns (None: traj.json not read yet)


class _Versions(msgspec.Struct):
    """The one field of a traj.json's trajectory the episode list needs."""

    weight_versions: list[str] = []


class _TrajEpisode(msgspec.Struct):
    """traj.json's episode, only as far as its weight versions."""

    trajectory: _Versions = msgspec.field(default_factory=_Versions)


class _TrajVersions(msgspec.Struct):
    """traj.json, read for its weight versions only (the rest of the file is skipped, not built)."""

    episode: _TrajEpisode = msgspec.field(default_factory=_TrajEpisode)


class RunSummary(msgspec.Struct, kw_only=True):
    """A run as the page's header and config table show it."""

    name: str
    path: str
    kind: str  # "up" or "eval"
    steps: int
    episodes: int
    config: dict[str, Any] = {}


class RunIndex:
    """The index of one run folder; ``refresh()`` picks up what was written since."""

    def __init__(self, path: Path) -> None:
        path = path.resolve()
        self._only: Path | None = None  # one ATIF file given alone
        if path.is_file() and is_atif(path):
            self._only, path = path, path.parent
        if not path.is_dir():
            raise ConfigError(f"{path}: no such folder")
        if self._only is not None:
            self.kind = "atif"
        elif (path / "metrics.jsonl").exists() or (path / "episodes").is_dir():
            self.kind = "up"
        elif (path / "results.jsonl").exists() or (path / "summary.json").exists():
            self.kind = "eval"
        elif any(is_atif(p) for p in path.rglob("*.json")):
            self.kind = "atif"
        else:
            raise ConfigError(f"{path}: not a run folder (no metrics.jsonl or episodes/ of `swectl up`, no "
                              "results.jsonl of `swectl eval`, no ATIF trajectory)")
        self.path = path
        self.name = path.name
        self.metrics: list[dict[str, Any]] = []
        self.episodes: dict[str, EpisodeRow] = {}
        self._offsets: dict[str, int] = {"metrics.jsonl": 0, "steps.jsonl": 0}  # also each rewards.jsonl
        self._seen_dirs: dict[Path, float] = {}  # folder -> its mtime when last listed
        self._groups: dict[tuple[str, str], list[EpisodeRow]] = {}  # (parent folder, instance_id) -> its episodes
        self._rewards: dict[tuple[str, str], list[float]] = {}  # the same key -> the rewards steps.jsonl gave it
        self._touched: set[tuple[str, str]] = set()  # groups whose rewards are to be matched again
        self._exact: set[str] = set()  # "<parent>/<instance_id>" groups that rewards.jsonl scored
        self._early: dict[str, float] = {}  # rewards.jsonl entries whose episode folder is not listed yet
        self.refresh()

    # ------------------------------------------------------------ keeping up

    def refresh(self) -> None:
        if self.kind == "atif":
            self._scan_atif()
            return
        self.metrics += self._read_lines("metrics.jsonl")
        for record in self._read_lines("steps.jsonl"):
            rewards = record.get("rewards")
            for instance_id, values in (rewards.items() if isinstance(rewards, dict) else ()):
                key = (f"episodes/step_{record['step']:06d}", instance_id)
                if isinstance(values, list) and all(isinstance(v, int | float) for v in values):
                    self._rewards[key] = [float(v) for v in values]
                    self._touched.add(key)
        exact: dict[str, float] = {}  # episode folder (relative) -> its reward, from rewards.jsonl
        for folder, phase in self._episode_parents():
            self._scan(folder, phase)
            parent = str(folder.relative_to(self.path))
            for line in self._read_lines(f"{parent}/{REWARDS_FILE}", need_step=False):
                if isinstance(line.get("reward"), int | float) and isinstance(line.get("sample"), int):
                    exact[f"{parent}/{line.get('instance_id')}__{line['sample']}"] = float(line["reward"])
                    self._exact.add(f"{parent}/{line.get('instance_id')}")
        for rel, reward in exact.items():
            if rel in self.episodes:
                self.episodes[rel].reward = reward
            else:
                self._early[rel] = reward  # its folder is listed by a later refresh
        for rel in [r for r in self._early if r in self.episodes]:
            self.episodes[rel].reward = self._early.pop(rel)
        # Runs recorded before rewards.jsonl: each step's rewards in steps.jsonl, matched by sample order
        for key in {k for k in self._touched & self._rewards.keys() if f"{k[0]}/{k[1]}" not in self._exact}:
            scored = sorted((r for r in self._groups.get(key, []) if r.scored), key=lambda r: r.sample)
            rewards = self._rewards[key]
            if len(scored) >= len(rewards):  # the group is all here (else: again when its last episode is)
                for row, reward in zip(scored, rewards, strict=False):
                    row.reward = reward
        self._touched.clear()

    def _read_lines(self, name: str, *, need_step: bool = True) -> list[dict[str, Any]]:
        """The whole new lines of a JSONL file of the run (objects, with an integer ``step`` when ``need_step``)
        since the last read."""
        try:
            with (self.path / name).open("rb") as f:
                f.seek(self._offsets.setdefault(name, 0))
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for its newline
        self._offsets[name] += end
        rows = []
        for raw in data[:end].splitlines():
            try:
                row = json.loads(raw)
            except ValueError:
                continue
            if isinstance(row, dict) and (not need_step or isinstance(row.get("step"), int)):
                rows.append(row)
        return rows

    def _episode_parents(self) -> list[tuple[Path, str]]:
        """The folders that hold episode folders, with their phase."""
        if self.kind == "eval":
            return [(self.path, "run")]
        parents = []
        for phase, top in (("train", self.path / "episodes"), ("eval", self.path / "eval")):
            try:
                children = sorted(p for p in top.iterdir() if p.is_dir())
            except OSError:
                continue
            parents += [(child, phase) for child in children]
            parents.append((top, phase))  # the async loop's group folders sit right under episodes/
        return parents

    def _scan(self, folder: Path, phase: str) -> None:
        try:
            mtime = folder.stat().st_mtime
        except OSError:
            return
        if self._seen_dirs.get(folder) == mtime:
            return
        self._seen_dirs[folder] = mtime
        step = _step_of(folder.name)
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for entry in entries:
            if not entry.is_dir() or "__" not in entry.name:
                continue
            rel = str(Path(entry.path).relative_to(self.path))
            if rel in self.episodes:
                continue
            row = _row(Path(entry.path), rel, phase, step)
            if row is not None:
                self.episodes[rel] = row
                key = (_parent(rel), row.instance_id)
                self._groups.setdefault(key, []).append(row)
                self._touched.add(key)

    def _scan_atif(self) -> None:
        """Each ATIF document not listed yet is an episode (its id: the file, relative to the folder)."""
        files = [self._only] if self._only is not None else sorted(self.path.rglob("*.json"))
        for file in files:
            rel = str(file.relative_to(self.path))
            if rel in self.episodes or not is_atif(file):
                continue
            row = _atif_row(file, rel)
            self.episodes[rel] = row
            self._groups.setdefault((_parent(rel), row.instance_id), []).append(row)

    # ------------------------------------------------------------ what the page asks

    def summary(self) -> RunSummary:
        config: dict[str, Any] = {}
        for name in ("config.json", "run.json"):
            try:
                config = json.loads((self.path / name).read_text())
                break
            except (OSError, ValueError):
                continue
        steps = max((r["step"] for r in self.metrics), default=0)
        return RunSummary(name=self.name, path=str(self.path), kind=self.kind, steps=steps,
                          episodes=len(self.episodes), config=config)

    def episode_rows(self, *, instance_id: str = "", phase: str = "", step: int | None = None,
                     sample: int | None = None, exit_status: str = "", resolved: bool | None = None,
                     reward_min: float | None = None, reward_max: float | None = None,
                     weight_version: str = "") -> list[EpisodeRow]:
        """The episodes that pass every filter given. An episode without a reward passes no reward bound; a
        weight version filter reads the weight versions of the episodes that passed the others (once each)."""
        rows = [r for r in self.episodes.values()
                if (not instance_id or r.instance_id == instance_id) and (not phase or r.phase == phase)
                and (step is None or r.step == step) and (sample is None or r.sample == sample)
                and (not exit_status or r.exit_status == exit_status)
                and (resolved is None or r.resolved == resolved)
                and (reward_min is None or (r.reward is not None and r.reward >= reward_min))
                and (reward_max is None or (r.reward is not None and r.reward <= reward_max))]
        if weight_version:
            rows = [r for r in rows if weight_version in self._versions(r)]
        return sorted(rows, key=lambda r: (r.phase, r.step, r.instance_id, r.sample))

    def _versions(self, row: EpisodeRow) -> list[str]:
        if row.weight_versions is None:
            try:
                traj = msgspec.json.decode((self.path / row.id / "traj.json").read_bytes(), type=_TrajVersions)
                row.weight_versions = sorted(set(traj.episode.trajectory.weight_versions), key=_version_order)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                row.weight_versions = []
        return row.weight_versions

    def tasks(self) -> list[dict[str, Any]]:
        """Per task: episodes, resolved, graded tampered, resolve rate, per step; its groups (the episodes of one
        training step, or of one `swectl eval` run) with signal (their rewards, else verdicts, differ) and without;
        whether it never resolves. Most resolved first."""
        by_task: dict[str, dict[str, Any]] = {}
        for r in self.episodes.values():
            t = by_task.setdefault(r.instance_id, {"instance_id": r.instance_id, "episodes": 0, "resolved": 0,
                                                    "tampered": 0, "steps": {}, "groups_with_signal": 0,
                                                    "groups_without_signal": 0})
            t["episodes"] += 1
            t["resolved"] += r.resolved
            t["tampered"] += r.grade == "tampered"
            cell = t["steps"].setdefault(f"{r.phase}:{r.step}", [0, 0])
            cell[0] += r.resolved
            cell[1] += 1
        for (_, instance_id), rows in self._groups.items():
            scored = [r for r in rows if r.scored and r.phase != "eval"]  # held-out readings are no groups
            if scored:
                known = all(r.reward is not None for r in scored)
                signal = len({r.reward if known else r.resolved for r in scored}) > 1
                by_task[instance_id]["groups_with_signal" if signal else "groups_without_signal"] += 1
        out = list(by_task.values())
        for t in out:
            t["resolve_rate"] = t["resolved"] / t["episodes"]
            t["never_resolved"] = t["resolved"] == 0
        return sorted(out, key=lambda t: (-t["resolve_rate"], t["instance_id"]))

    def episode(self, rel: str) -> dict[str, Any]:
        """One episode in full: its turns, steps, patch, grade and the tail of its grading log."""
        folder = (self.path / rel).resolve()
        if self.path not in folder.parents or rel not in self.episodes:
            raise KeyError(rel)
        row = self.episodes[rel]
        if self.kind == "atif":
            return _atif_episode(folder, row, [r.id for r in self._groups[(_parent(rel), row.instance_id)]
                                               if r.id != rel])
        out: dict[str, Any] = {"messages": [], "steps": [], "patch": "", "grade": None, "log": "", "problems": [],
                               "samples": [], "context_cuts": [], "format_errors": [],
                               "group": [r.id for r in sorted(self._groups[(_parent(rel), row.instance_id)],
                                                              key=lambda r: r.sample) if r.id != rel]}
        try:
            traj = json.loads((folder / "traj.json").read_bytes().decode("utf-8", errors="replace"))
            episode = traj.get("episode", {})
            trajectory = episode.get("trajectory", {})
            out["messages"] = [_shown_message(m) for m in trajectory.get("messages", [])]
            out["steps"] = episode.get("steps", [])
            out["weight_versions"] = trajectory.get("weight_versions", [])
            row.weight_versions = sorted(set(out["weight_versions"]), key=_version_order)
            out["reason"] = episode.get("reason", "")
            # per step as the model saw it (head+tail context management, per-step samples): tokens in and out
            out["samples"] = [{"step": s.get("step", 0), "prompt_tokens": len(s.get("prompt_ids", [])),
                               "output_tokens": len(s.get("output_ids", [])),
                               "weight_version": s.get("weight_version", ""),
                               "omitted_turns": s.get("omitted_turns", 0)} for s in episode.get("samples", [])]
            out["context_cuts"] = [{"turn": s["step"] + 1, "omitted_turns": s["omitted_turns"]}
                                   for s in out["samples"] if s["omitted_turns"]]
            out["format_errors"] = [i + 1 for i, s in enumerate(out["steps"]) if s.get("format_error")]
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            out["problems"].append(f"traj.json: {exc}")
        out["row"] = msgspec.to_builtins(row)
        try:
            out["patch"] = (folder / "patch.diff").read_bytes().decode("utf-8", errors="replace")
        except OSError:
            out["problems"].append("no patch.diff")
        try:
            meta = json.loads((folder / "meta.json").read_text(errors="replace"))
            out["grade"] = meta.get("grade")
        except (OSError, ValueError) as exc:
            out["problems"].append(f"meta.json: {exc}")
        log_path = (out["grade"] or {}).get("log_path") or ""
        if log_path:
            try:
                text = self._log(Path(log_path)).read_bytes().decode("utf-8", errors="replace")
                out["log"] = text[-LOG_TAIL_CHARS:]
            except OSError:
                out["problems"].append(f"grading log {log_path} is not here (a run copied from elsewhere?)")
        return out

    def _log(self, path: Path) -> Path:
        """A grading log where it was written, else at the same place in this run folder (a copied run)."""
        if path.exists():
            return path
        for keep in range(min(len(path.parts) - 1, 4), 1, -1):  # e.g. episodes/step_000001/grade-logs/x.log
            here = (self.path / Path(*path.parts[-keep:])).resolve()
            if self.path in here.parents and here.exists():
                return here
        return path


def _parent(rel: str) -> str:
    return str(Path(rel).parent)


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (1 << 62, version)


def _step_of(name: str) -> int:
    found = _STEP_FOLDER.match(name) or _GROUP_FOLDER.match(name)
    return int(found.group(1)) if found else 0


def _row(folder: Path, rel: str, phase: str, step: int) -> EpisodeRow | None:
    """The list row of one episode folder from its meta.json (None while it is not written yet)."""
    try:
        meta = json.loads((folder / "meta.json").read_text(errors="replace"))
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    grade = meta.get("grade") if isinstance(meta.get("grade"), dict) else {}
    outcome = str(meta.get("outcome", ""))
    return EpisodeRow(id=rel, phase=phase, step=step, instance_id=str(meta.get("instance_id", "")),
                      sample=int(meta.get("sample", 0) or 0), exit_status=str(meta.get("exit_status", "")),
                      outcome=outcome, resolved=bool(meta.get("resolved", False)), grade=str(grade.get("status", "")),
                      turns=int(meta.get("turns", 0) or 0), total_time_s=float(meta.get("total_time_s", 0) or 0),
                      scored=outcome != "ABORTED" and not grade.get("infra"))


def _shown_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        return {"role": "?", "content": str(message), "chars": len(str(message)), "cut": False}
    content = message.get("content", "")
    content = content if isinstance(content, str) else json.dumps(content)
    cut = len(content) > OBSERVATION_SHOWN_CHARS
    shown = content[:OBSERVATION_SHOWN_CHARS // 2] + "\n[... cut ...]\n" + content[-OBSERVATION_SHOWN_CHARS // 2:] \
        if cut else content
    return {"role": message.get("role", "?"), "content": shown, "chars": len(content), "cut": cut}


# ---------------------------------------------------------------------------------------------- ATIF documents


def _harbor_trial(file: Path) -> Path | None:
    """The Harbor trial folder of a trajectory at ``<trial>/agent/trajectory.json`` (it holds result.json)."""
    trial = file.parent.parent
    return trial if file.parent.name == "agent" and (trial / "result.json").is_file() else None


def _harbor_reward(trial: Path | None) -> float | None:
    if trial is None:
        return None
    try:
        result = json.loads((trial / "result.json").read_text(errors="replace"))
        rewards = (result.get("verifier_result") or {}).get("rewards") or {}
        reward = rewards.get("reward")
        return float(reward) if isinstance(reward, int | float) else None
    except (OSError, ValueError, AttributeError):
        return None


def _atif_row(file: Path, rel: str) -> EpisodeRow:
    trial = _harbor_trial(file)
    try:
        doc = read_atif(file)
    except TaskDataError:
        return EpisodeRow(id=rel, phase="run", step=0, instance_id=file.stem, sample=0, outcome="unreadable",
                          scored=False)
    ours = (doc.extra or {}).get("swectl") or {}
    name = str(ours.get("instance_id") or (trial.name.rsplit("__", 1)[0] if trial else file.name.split(".")[0]))
    reward = _harbor_reward(trial)
    resolved = bool(ours.get("resolved")) if ours else reward is not None and reward >= 1.0
    return EpisodeRow(id=rel, phase="run", step=0, instance_id=name, sample=int(ours.get("sample", 0) or 0),
                      exit_status=str(ours.get("exit_status", "")), outcome=str(ours.get("outcome", "")),
                      resolved=resolved, grade=str(ours.get("grade", "")),
                      turns=sum(s.source == "agent" for s in doc.steps),
                      total_time_s=float(ours.get("total_time_s", 0) or 0), reward=reward,
                      weight_versions=sorted({str(((s.extra or {}).get("swectl") or {}).get("weight_version", ""))
                                              for s in doc.steps if s.source == "agent"} - {""}, key=_version_order))


def _atif_episode(file: Path, row: EpisodeRow, group: list[str]) -> dict[str, Any]:
    """An ATIF document as the page shows an episode: its messages, one step per agent step (the command of its
    tool calls), the patch and grade swectl recorded in its extra, or the Harbor trial's verifier output."""
    out: dict[str, Any] = {"messages": [], "steps": [], "patch": "", "grade": None, "log": "", "problems": [],
                           "samples": [], "context_cuts": [], "format_errors": [], "group": group,
                           "row": msgspec.to_builtins(row), "format": "ATIF"}
    try:
        doc = read_atif(file)
    except TaskDataError as exc:
        out["problems"].append(str(exc))
        return out
    out["messages"] = [_shown_message(m) for m, _ in conversation_of(doc)]
    for s in doc.steps:
        if s.source != "agent":
            continue
        ours = (s.extra or {}).get("swectl") or {}
        calls = s.tool_calls or []
        action = "\n".join(str(c.arguments.get("command")) if set(c.arguments) == {"command"}
                           else f"{c.function_name}({json.dumps(c.arguments)})" for c in calls)
        out["steps"].append({"action": action, "returncode": ours.get("returncode"),
                             "format_error": bool(ours.get("format_error")),
                             "copied_context": bool(s.is_copied_context),
                             "output_tokens": len((s.metrics.completion_token_ids or []) if s.metrics else [])})
    out["format_errors"] = [i + 1 for i, s in enumerate(out["steps"]) if s["format_error"]]
    out["weight_versions"] = row.weight_versions or []
    ours = (doc.extra or {}).get("swectl") or {}
    out["patch"] = str(ours.get("patch", ""))
    out["reason"] = str(ours.get("reason", ""))
    if ours.get("grade"):
        out["grade"] = {"status": ours["grade"]}
    trial = _harbor_trial(file)
    if trial is not None:
        out["grade"] = {"status": "resolved" if row.resolved else "unresolved", "reward": row.reward}
        for name in ("verifier/test-stdout.txt", "verifier/stdout.txt"):
            try:
                out["log"] = (trial / name).read_bytes().decode("utf-8", errors="replace")[-LOG_TAIL_CHARS:]
                break
            except OSError:
                continue
    return out
