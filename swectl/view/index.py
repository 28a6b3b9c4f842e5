"""What `swectl view` knows of a run folder: its curves, its episodes, one episode in full.

A run folder is a `swectl up` run (``metrics.jsonl``, ``episodes/``, ``eval/``) or a `swectl eval` output
(``results.jsonl``, ``<instance_id>__<n>/``). The index is built once and brought up to date by ``refresh``: new
lines of ``metrics.jsonl`` are read from where the last read stopped (a partial last line waits for its end), and
only episode folders not seen before are read (their ``meta.json``; trajectories are read when an episode is
opened). Nothing here writes to the run folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import msgspec

from swectl.errors import ConfigError

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
        if not path.is_dir():
            raise ConfigError(f"{path}: no such folder")
        if (path / "metrics.jsonl").exists() or (path / "episodes").is_dir():
            self.kind = "up"
        elif (path / "results.jsonl").exists() or (path / "summary.json").exists():
            self.kind = "eval"
        else:
            raise ConfigError(f"{path}: not a run folder (no metrics.jsonl or episodes/ of `swectl up`, no "
                              "results.jsonl of `swectl eval`)")
        self.path = path
        self.name = path.name
        self.metrics: list[dict[str, Any]] = []
        self.episodes: dict[str, EpisodeRow] = {}
        self._metrics_offset = 0
        self._seen_dirs: dict[Path, float] = {}  # folder -> its mtime when last listed
        self.refresh()

    # ------------------------------------------------------------ keeping up

    def refresh(self) -> None:
        self._read_metrics()
        for folder, phase in self._episode_parents():
            self._scan(folder, phase)

    def _read_metrics(self) -> None:
        path = self.path / "metrics.jsonl"
        try:
            with path.open("rb") as f:
                f.seek(self._metrics_offset)
                data = f.read()
        except OSError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for its newline
        for raw in data[:end].splitlines():
            try:
                row = json.loads(raw)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                self.metrics.append(row)
        self._metrics_offset += end

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
                     exit_status: str = "", resolved: bool | None = None) -> list[EpisodeRow]:
        rows = [r for r in self.episodes.values()
                if (not instance_id or r.instance_id == instance_id) and (not phase or r.phase == phase)
                and (step is None or r.step == step) and (not exit_status or r.exit_status == exit_status)
                and (resolved is None or r.resolved == resolved)]
        return sorted(rows, key=lambda r: (r.phase, r.step, r.instance_id, r.sample))

    def tasks(self) -> list[dict[str, Any]]:
        """Per task: episodes, resolved, resolve rate, per step of training; tasks that never resolve last."""
        by_task: dict[str, dict[str, Any]] = {}
        for r in self.episodes.values():
            t = by_task.setdefault(r.instance_id, {"instance_id": r.instance_id, "episodes": 0, "resolved": 0,
                                                    "steps": {}})
            t["episodes"] += 1
            t["resolved"] += r.resolved
            cell = t["steps"].setdefault(f"{r.phase}:{r.step}", [0, 0])
            cell[0] += r.resolved
            cell[1] += 1
        out = list(by_task.values())
        for t in out:
            t["resolve_rate"] = t["resolved"] / t["episodes"]
        return sorted(out, key=lambda t: (-t["resolve_rate"], t["instance_id"]))

    def episode(self, rel: str) -> dict[str, Any]:
        """One episode in full: its turns, steps, patch, grade and the tail of its grading log."""
        folder = (self.path / rel).resolve()
        if self.path not in folder.parents or rel not in self.episodes:
            raise KeyError(rel)
        row = self.episodes[rel]
        out: dict[str, Any] = {"row": msgspec.to_builtins(row), "messages": [], "steps": [], "patch": "",
                               "grade": None, "log": "", "problems": []}
        try:
            traj = json.loads((folder / "traj.json").read_bytes().decode("utf-8", errors="replace"))
            episode = traj.get("episode", {})
            out["messages"] = [_shown_message(m) for m in episode.get("trajectory", {}).get("messages", [])]
            out["steps"] = episode.get("steps", [])
            out["weight_versions"] = episode.get("trajectory", {}).get("weight_versions", [])
            out["reason"] = episode.get("reason", "")
        except (OSError, ValueError) as exc:
            out["problems"].append(f"traj.json: {exc}")
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
                text = Path(log_path).read_bytes().decode("utf-8", errors="replace")
                out["log"] = text[-LOG_TAIL_CHARS:]
            except OSError:
                out["problems"].append(f"grading log {log_path} is not here (a run copied from elsewhere?)")
        return out


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
    grade = meta.get("grade") or {}
    return EpisodeRow(id=rel, phase=phase, step=step, instance_id=str(meta.get("instance_id", "")),
                      sample=int(meta.get("sample", 0) or 0), exit_status=str(meta.get("exit_status", "")),
                      outcome=str(meta.get("outcome", "")), resolved=bool(meta.get("resolved", False)),
                      grade=str(grade.get("status", "")) if isinstance(grade, dict) else "",
                      turns=int(meta.get("turns", 0) or 0), total_time_s=float(meta.get("total_time_s", 0) or 0))


def _shown_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        return {"role": "?", "content": str(message), "chars": len(str(message)), "cut": False}
    content = message.get("content", "")
    content = content if isinstance(content, str) else json.dumps(content)
    cut = len(content) > OBSERVATION_SHOWN_CHARS
    shown = content[:OBSERVATION_SHOWN_CHARS // 2] + "\n[... cut ...]\n" + content[-OBSERVATION_SHOWN_CHARS // 2:] \
        if cut else content
    return {"role": message.get("role", "?"), "content": shown, "chars": len(content), "cut": cut}
