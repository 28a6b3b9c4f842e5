"""Recipes: a multi-phase run as data (`swectl up` with no FILE runs the bundled first run; `swectl up --recipe FILE`).

A recipe is a TOML file (the bundled ones are in swectl/data/bundled/recipes/; docs/recipes.md says every field):

- ``[vars]``: the recipe's numbers, typed (``--set recipe.NAME=VALUE`` sets one; a var may say ``"{other}"``);
- ``[split]``: the seeded train / held-out split of a task set, made once before the phases and recorded as the run
  folder's ``train.jsonl`` and ``test.jsonl`` (and ``split.json``);
- ``[config]``: the overlay of the cluster config every phase that takes a config gets, and each ``[[phase]]``'s
  ``config``: its own overlay on top. Overlays are tables of the config's own keys with TOML's own types, checked
  against the config before any phase runs;
- ``[[phase]]``: ``name`` (its folder in the run folder), ``kind`` (``model``, ``data`` (``data gold``),
  ``judge-data`` (``data judge``, writing ``judge.jsonl`` in its folder), ``train``, ``eval``, ``plot``: which swectl
  command it is), ``after`` (the phases it waits for: phases whose ``after`` have finished
  run at once, siblings in one task group), ``args`` (the command's own flags), ``output`` (``log``: its output goes
  to ``NAME.log`` in the run folder, for a phase beside another);
- ``[report]``: which eval phases are the readings summary.json and the closing table show, and the gain between
  two of them.

Strings in vars, split, overlays and args are templates: ``{run}`` is the run folder, ``{NAME}`` a var or a phase's
folder, ``{NAME.weights}`` a finished train phase's final weights; a string that is one ``{...}`` alone takes that
value's type (``train.steps = "{sft_steps}"`` is an integer); ``{{`` is a brace.

This module is the recipe as data: reading, templating, the checks that need no command, the phase records and
the ETA. swectl/cli/phases.py runs the phases by the commands' own drivers.
"""

from __future__ import annotations

import os
import re
import statistics
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec

from swectl.config import merge_tables as merge
from swectl.config import toml_value
from swectl.errors import ConfigError, SwectlError

RECIPES_DIR = Path(__file__).resolve().parents[1] / "data" / "bundled" / "recipes"
DEFAULT_RECIPE = "first-run"
RECIPE_FILE = "recipe.json"  # the resolved recipe of a run folder (a resumed run reads it back)
PHASES_FILE = "phases.json"  # the finished phases of a run folder: seconds, command line, weights
SUMMARY_FILE = "summary.json"
LOG_FILE = "swectl.log"
Kind = Literal["model", "data", "judge-data", "train", "eval", "plot"]
# the settings whose product is a phase's size, for scaling an earlier run's seconds to this recipe's numbers
SIZE_KEYS = (("train", "steps"), ("train", "data", "sft_batch_size"), ("train", "sampling", "tasks_per_step"),
             ("train", "sampling", "n_samples"), ("rollout", "samples"))
_REF = re.compile(r"\{\{|\}\}|\{([A-Za-z_][\w-]*(?:\.weights)?)\}")


class Phase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One step of a recipe: one swectl command, run in the run folder's ``name/``."""

    name: str
    kind: Kind
    after: list[str] = []
    about: str = ""  # what the phase line says it does (a template)
    args: dict[str, Any] = {}  # the command's own flags: --KEY VALUE, a list repeats the flag, true a bare flag
    config: dict[str, Any] = {}  # this phase's overlay of the cluster config, on the recipe's [config]
    output: Literal["terminal", "log"] = "terminal"  # log: into the run folder's NAME.log (beside another phase)
    optional: bool = False  # a failure is said and the run goes on (nothing waits for it)
    folder: str = ""  # its folder in the run folder ("": its name; ".": the run folder itself)

    def path(self, run_dir: Path) -> Path:
        return run_dir / (self.folder or self.name)


class Split(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The seeded train / held-out split, made once."""

    tasks: Any = ""  # a task set (--tasks); "": the bundled tasks
    test_fraction: Any = 0.5
    seed: Any = 0


class ReadingSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One reading the report shows: an eval phase under a name and a label."""

    name: str  # its key in summary.json's readings
    phase: str  # an eval phase
    label: str = ""  # its row in the table


class Report(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What summary.json and the closing table say: the readings, the gain of one over another, SFT's speed."""

    reading: list[ReadingSpec] = []
    gain: list[str] = []  # [before, after]: two reading names
    gain_label: str = "gain"
    # [before, after] of a control (the same training with the signal removed): its gain must stay within noise
    control: list[str] = []
    control_label: str = "control"
    speed: str = ""  # a train phase whose median step time the table shows (the machine's speed that run)
    note: str = ""  # a line the table adds


class RecipeFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A recipe as written (vars unresolved)."""

    description: str = ""
    base: str = ""  # the cluster config FILE the phases start from ("": the embedded default)
    # the harness config a user's --set agent.harness=... runs with when they name none ("": the config's default)
    harness_config: str = ""
    vars: dict[str, Any] = {}
    split: Split | None = None
    config: dict[str, Any] = {}
    phase: list[Phase] = []
    report: Report | None = None


class Recipe(msgspec.Struct, frozen=True, kw_only=True):
    """A recipe with its vars resolved: what a run folder records (recipe.json) and runs."""

    name: str
    source: str
    file: RecipeFile
    vars: dict[str, Any]
    # the user's other --set KEY=VALUE overrides (every phase's, last): a resumed run applies them again, then its own
    sets: list[str] = []

    def phase(self, name: str) -> Phase:
        return next(p for p in self.file.phase if p.name == name)

    @property
    def trains(self) -> list[Phase]:
        return [p for p in self.file.phase if p.kind == "train"]


class PhaseRecord(msgspec.Struct, kw_only=True):
    """A finished phase, in phases.json."""

    seconds: float
    argv: list[str]
    size: float = 1.0
    weights: str = ""  # a train phase's final weights


class Reading(msgspec.Struct, frozen=True, kw_only=True):
    """A finished eval phase's numbers (its summary.json, read as eval's AgentSummary)."""

    resolve_rate: float
    resolved: int
    episodes: int
    aborted: int
    folder: str
    model: str
    seed: int


class Summary(msgspec.Struct, kw_only=True):
    """``summary.json`` of a recipe run."""

    recipe: str
    seed: int | None
    readings: dict[str, Reading]
    gain_points: float | None  # the report's after reading minus its before reading, in percentage points
    # one standard error of that difference: from the episode-by-episode differences when the two readings are paired
    # (same tasks, samples and sampling seed: gain_paired), else as two independent binomial readings
    gain_noise_points: float | None
    minutes: float
    phases_s: dict[str, float]
    run_dir: str
    vars: dict[str, Any]
    # The machine's speed during the run (the report's speed phase, median over its steps): on a shared VM the same
    # run's speed moves by the hour (docs/results.md, "2026-11-29 (later) — the first run from 19.8 to 31.8 minutes
    # on one machine"), so the minutes are read beside these
    sft_step_s: float = 0.0
    sft_tokens_per_s: float = 0.0
    control_gain_points: float | None = None  # the report's control: its after reading minus its before reading
    control_noise_points: float | None = None
    gain_paired: bool = False
    control_paired: bool = False


# ---------------------------------------------------------------- reading a recipe


def recipe_path(name: str, relative_to: Path | None = None) -> Path:
    """A bundled recipe's name (``first-run``) or a recipe FILE (relative to ``relative_to``, when given: where the
    recipe that names it lives)."""
    bundled = RECIPES_DIR / f"{name}.toml"
    if "/" not in name and not name.endswith(".toml") and bundled.is_file():
        return bundled
    path = relative_to / name if relative_to is not None and not Path(name).is_absolute() else Path(name)
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in RECIPES_DIR.glob("*.toml")))
        raise ConfigError(f"recipe {name}: no such file{f' (in {relative_to})' if relative_to else ''}, and not a "
                          f"bundled recipe (those: {known})")
    return path


def read_recipe(name: str, drop: list[str] | tuple[str, ...] = ()) -> RecipeFile:
    """The recipe FILE (or bundled name), what it extends merged in, the phases ``drop`` names left out, decoded and
    checked for its own consistency."""
    path = recipe_path(name)
    document = _document(path, ())
    if drop:
        document = extend(document, {}, list(drop), str(path))
    try:
        recipe = msgspec.convert(document, RecipeFile)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"recipe {path}: {exc}") from exc
    check_phases(recipe, str(path))
    return recipe


def _document(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """A recipe file's TOML table with the recipe it ``extends`` merged under it."""
    if path.resolve() in chain:
        raise ConfigError(f"recipe {path}: extends itself (through {' -> '.join(str(p) for p in chain)})")
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"recipe {path}: cannot read it ({exc})") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"recipe {path}: invalid TOML: {exc}") from exc
    parent = document.pop("extends", None)
    drop = document.pop("drop", [])
    if parent is None:
        if drop:
            raise ConfigError(f"recipe {path}: drop names phases of the recipe it extends, and it extends none")
        if any(isinstance(p, dict) and "like" in p for p in document.get("phase", [])):
            raise ConfigError(f"recipe {path}: a phase's like names a phase of the recipe it extends, and it "
                              "extends none")
        return document
    if not isinstance(parent, str) or not isinstance(drop, list) or not all(isinstance(d, str) for d in drop):
        raise ConfigError(f"recipe {path}: extends is a recipe's name or file, drop a list of phase names")
    base = _document(recipe_path(parent, path.parent), (*chain, path.resolve()))
    return extend(base, document, drop, str(path))


def extend(base: dict[str, Any], child: dict[str, Any], drop: list[str], source: str) -> dict[str, Any]:
    """``child`` (a recipe's TOML table) on top of the recipe it extends (``base``, already merged):

    - its tables (vars, split, config, report) merge key by key into base's, its own values winning; its other
      values (description, base, harness_config) replace base's;
    - ``drop``: base's phases left out, with the report's readings of them (and a gain or speed naming them);
    - each ``[[phase]]``: one of base's names changes that phase (its tables merged, its other fields replaced);
      ``like = "NAME"`` makes a new phase from a copy of base's NAME (dropped or not), changed the same way; any other
      is a new phase, after base's.
    """
    phases = [dict(p) for p in base.get("phase", [])]
    originals = {p["name"]: p for p in phases if isinstance(p.get("name"), str)}
    unknown = [name for name in drop if name not in originals]
    if unknown:
        raise ConfigError(f"recipe {source}: drop names {', '.join(unknown)}, not phases of the recipe it extends "
                          f"({', '.join(originals)})")
    phases = [p for p in phases if p.get("name") not in drop]
    out = {k: v for k, v in base.items() if k != "phase"}
    for key, value in child.items():
        if key == "phase":
            continue
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    _drop_from_report(out, base.get("report"), child.get("report"), drop)
    for new in child.get("phase", []):
        if not isinstance(new, dict) or not isinstance(new.get("name"), str):
            raise ConfigError(f"recipe {source}: each [[phase]] needs a name")
        new = dict(new)
        like = new.pop("like", None)
        names = [p["name"] for p in phases]
        if like is not None:
            if like not in originals and like not in names:
                raise ConfigError(f"recipe {source}: phase {new['name']}: like names {like!r}, not a phase of the "
                                  f"recipe it extends ({', '.join(originals)})")
            if new["name"] in names:
                raise ConfigError(f"recipe {source}: phase {new['name']}: like makes a new phase, and "
                                  f"{new['name']!r} is one already (change it by its name, without like)")
            template = next((p for p in phases if p["name"] == like), None) or originals[like]
            phases.append(merge(template, new))
        elif new["name"] in names:
            index = names.index(new["name"])
            phases[index] = merge(phases[index], new)
        else:
            phases.append(new)
    out["phase"] = phases
    return out


def _drop_from_report(out: dict[str, Any], base: Any, child: Any, drop: list[str]) -> None:
    """The merged report without the readings of dropped phases (readings merged by name, base's first)."""
    if not isinstance(out.get("report"), dict):
        return
    report = out["report"]
    readings: dict[str, Any] = {}
    for table in (base, child):
        for spec in (table or {}).get("reading", []) if isinstance(table, dict) else []:
            if isinstance(spec, dict) and isinstance(spec.get("name"), str):
                readings[spec["name"]] = {**readings.get(spec["name"], {}), **spec}
    kept = {name: spec for name, spec in readings.items() if spec.get("phase") not in drop}
    report["reading"] = list(kept.values())
    for key in ("gain", "control"):
        if any(name not in kept for name in report.get(key, [])):
            report[key] = []
    if report.get("speed") in drop:
        report["speed"] = ""


def check_phases(recipe: RecipeFile, source: str) -> None:
    """Names unique and usable as folders, ``after`` naming earlier phases, the report naming eval phases."""
    if not recipe.phase:
        raise ConfigError(f"recipe {source}: no [[phase]]")
    seen: dict[str, Phase] = {}
    reserved = {"run", *builtins(), *recipe.vars}
    for phase in recipe.phase:
        if not re.fullmatch(r"[A-Za-z0-9][\w-]*", phase.name) or phase.name in reserved or phase.name in seen:
            raise ConfigError(f"recipe {source}: phase name {phase.name!r} is not a new folder name (letters, digits, "
                              f"- and _; not a var, not 'run', not used twice)")
        for before in phase.after:
            if before not in seen:
                raise ConfigError(f"recipe {source}: phase {phase.name} waits for {before!r}, which is not a phase "
                                  "above it")
        if phase.kind == "train" and phase.args:
            raise ConfigError(f"recipe {source}: phase {phase.name}: a train phase takes config, not args")
        waits = _ancestors(phase, seen)
        for ref in _refs([phase.args, phase.config, phase.about]):
            base, _, field = ref.partition(".")
            if field and base not in waits:
                raise ConfigError(f"recipe {source}: phase {phase.name} names {{{ref}}} but does not wait for "
                                  f"{base} (add it to after)")
        seen[phase.name] = phase
    report = recipe.report
    if report is not None:
        names = {r.name for r in report.reading}
        for spec in report.reading:
            if spec.phase not in seen or seen[spec.phase].kind != "eval":
                raise ConfigError(f"recipe {source}: report reading {spec.name} names {spec.phase!r}, not an eval "
                                  "phase")
        for key, pair in (("gain", report.gain), ("control", report.control)):
            if pair and (len(pair) != 2 or not set(pair) <= names):
                raise ConfigError(f"recipe {source}: report.{key} must name two of the readings "
                                  f"({', '.join(names)})")
        if report.speed and (report.speed not in seen or seen[report.speed].kind != "train"):
            raise ConfigError(f"recipe {source}: report.speed names {report.speed!r}, not a train phase")


def _ancestors(phase: Phase, seen: dict[str, Phase]) -> set[str]:
    out: set[str] = set()
    todo = list(phase.after)
    while todo:
        name = todo.pop()
        if name not in out and name in seen:
            out.add(name)
            todo += seen[name].after
    return out


def resolve_vars(recipe: RecipeFile, overrides: dict[str, Any], source: str) -> dict[str, Any]:
    """The recipe's vars with ``recipe.NAME=VALUE`` overrides (each of a var the recipe has), templates resolved."""
    unknown = sorted(set(overrides) - set(recipe.vars))
    if unknown:
        raise ConfigError(f"recipe {source}: no var {', '.join(unknown)} (its vars: {', '.join(recipe.vars)})")
    typed = _resolve(recipe.vars, source) if overrides else {}  # a var "{other}" has the type of what it names
    for key, value in overrides.items():
        default = typed[key]
        if isinstance(default, bool) != isinstance(value, bool) or (
                isinstance(default, int | float) and not isinstance(value, int | float)) or (
                isinstance(default, str) and not isinstance(value, str)):
            raise ConfigError(f"recipe.{key}={value!r}: the recipe's {key} is {type(default).__name__} "
                              f"({default!r})")
    return _resolve({**recipe.vars, **overrides}, source)


def _resolve(raw: dict[str, Any], source: str) -> dict[str, Any]:
    resolved: dict[str, Any] = builtins()
    for _ in range(len(raw) + 1):  # vars may name vars; each pass resolves one more level
        pending = {k: v for k, v in raw.items() if k not in resolved}
        if not pending:
            return {k: resolved[k] for k in raw}
        for key, value in pending.items():
            if not _refs(value) - set(resolved):
                resolved[key] = fill(value, resolved, f"recipe.{key}")
    missing = sorted(set(raw) - set(resolved))
    raise ConfigError(f"recipe {source}: vars {', '.join(missing)} name each other or an unknown name")


def load(name: str, overrides: dict[str, Any], drop: list[str] | tuple[str, ...] = ()) -> Recipe:
    """A bundled recipe or FILE with ``recipe.NAME`` overrides (and the phases ``drop`` names left out)."""
    path = recipe_path(name)
    file = read_recipe(name, drop)
    return Recipe(name=path.stem, source=str(path), file=file, vars=resolve_vars(file, overrides, str(path)))


def saved_recipe(run_dir: Path, overrides: dict[str, Any]) -> Recipe | None:
    """A run folder's recorded recipe (recipe.json) with new ``recipe.NAME`` overrides; None when it has none."""
    path = run_dir / RECIPE_FILE
    if not path.is_file():
        return None
    try:
        saved = msgspec.json.decode(path.read_bytes(), type=Recipe)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ConfigError(f"{path}: not a recipe run's record ({exc})") from exc
    check_phases(saved.file, str(path))
    vars_ = resolve_vars(saved.file, {**_unfilled(saved), **overrides}, str(path)) if overrides else saved.vars
    return msgspec.structs.replace(saved, vars=vars_)


def _unfilled(saved: Recipe) -> dict[str, Any]:
    """The saved run's own var values, as overrides (so new overrides change only what they name)."""
    return {k: v for k, v in saved.vars.items() if k in saved.file.vars}


# ---------------------------------------------------------------- templates


def builtins() -> dict[str, Any]:
    """Names every template may use besides the vars: ``cores``, this machine's CPU count."""
    return {"cores": os.cpu_count() or 1}


def _refs(value: Any) -> set[str]:
    if isinstance(value, str):
        return {m.group(1) for m in _REF.finditer(value) if m.group(1)}
    if isinstance(value, list):
        return {r for v in value for r in _refs(v)}
    if isinstance(value, dict):
        return {r for v in value.values() for r in _refs(v)}
    return set()


def fill(value: Any, names: dict[str, Any], where: str) -> Any:
    """``value`` with its ``{NAME}``s replaced from ``names``; a string that is one ``{NAME}`` alone becomes that
    value itself (typed). An unknown name is a ConfigError naming ``where``."""
    if isinstance(value, list):
        return [fill(v, names, where) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, names, f"{where}.{k}") for k, v in value.items()}
    if not isinstance(value, str):
        return value
    whole = _REF.fullmatch(value)
    if whole and whole.group(1):
        return _lookup(whole.group(1), names, where)

    def one(match: re.Match[str]) -> str:
        if not match.group(1):
            return match.group(0)[0]  # {{ or }}
        return str(_lookup(match.group(1), names, where))

    return _REF.sub(one, value)


def _lookup(name: str, names: dict[str, Any], where: str) -> Any:
    if name not in names:
        raise ConfigError(f"{where}: {{{name}}} is not a var, 'run', or a phase above this one "
                          f"(known: {', '.join(sorted(names))})")
    return names[name]


def names_for(recipe: Recipe, run_dir: Path, records: dict[str, PhaseRecord], phase: Phase | None) -> dict[str, Any]:
    """What a phase's templates may name: the vars, ``run``, the phases above it (folders) and the train phases
    it waits for (``NAME.weights``: recorded, or where they will be when it has not run yet)."""
    names: dict[str, Any] = {**recipe.vars, **builtins(), "run": str(run_dir)}
    for other in recipe.file.phase:
        if phase is not None and other.name == phase.name:
            break
        names[other.name] = str(other.path(run_dir))
        if other.kind == "train":
            record = records.get(other.name)
            names[f"{other.name}.weights"] = record.weights if record and record.weights else \
                str(other.path(run_dir) / "weights" / "final")
    return names


def overlay(recipe: Recipe, phase: Phase, names: dict[str, Any]) -> dict[str, Any]:
    """The phase's config overlay: the recipe's [config] with the phase's own on top, templates filled."""
    return merge(fill(recipe.file.config, names, "config"), fill(phase.config, names, f"{phase.name}.config"))


def leaves(document: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted.key, value)`` for each value of a nested overlay (a list is one value)."""
    out: list[tuple[str, Any]] = []
    for key, value in document.items():
        if isinstance(value, dict):
            out += leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def set_flags(document: dict[str, Any]) -> list[str]:
    """``--set KEY=VALUE`` for each value of an overlay."""
    return [x for key, value in leaves(document) for x in ("--set", f"{key}={toml_value(value)}")]


def arg_flags(args: dict[str, Any]) -> list[str]:
    """A phase's args as the command's flags: ``--KEY VALUE`` (underscores as dashes), a list repeating the flag, true
    a bare flag and false none."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        for one in value if isinstance(value, list) else [value]:
            if one is True:
                flags.append(flag)
            elif one is not False:
                flags += [flag, str(one)]
    return flags


def size(document: dict[str, Any]) -> float:
    """The product of a phase overlay's SIZE_KEYS values that it has (1 when none)."""
    total = 1.0
    for path in SIZE_KEYS:
        node: Any = document
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, int | float) and not isinstance(node, bool) and node > 0:
            total *= node
    return total


# ---------------------------------------------------------------- records and the ETA


def read_records(run_dir: Path) -> dict[str, PhaseRecord]:
    path = run_dir / PHASES_FILE
    if not path.is_file():
        return {}
    try:
        return msgspec.json.decode(path.read_bytes(), type=dict[str, PhaseRecord])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SwectlError(f"{path}: not a recipe run's phase record ({exc}); delete it to run every phase again") \
            from exc


def write_records(run_dir: Path, records: dict[str, PhaseRecord]) -> None:
    path = run_dir / PHASES_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(records)) + b"\n")
    tmp.replace(path)


def previous_run(out_dir: Path, recipe: Recipe, exclude: Path) -> tuple[dict[str, PhaseRecord], Path] | None:
    """The newest earlier run of the same recipe in ``out_dir`` (not ``exclude``) that finished every phase: its
    records and folder; None when this machine has none."""
    found: list[tuple[float, Path]] = []
    for path in out_dir.glob(f"*/{PHASES_FILE}"):
        if path.parent.resolve() != exclude.resolve() and (path.parent / SUMMARY_FILE).is_file():
            found.append((path.stat().st_mtime, path.parent))
    wanted = {p.name for p in recipe.file.phase}
    for _, folder in sorted(found, reverse=True):
        try:
            past = msgspec.json.decode((folder / RECIPE_FILE).read_bytes(), type=Recipe)
            records = read_records(folder)
        except (OSError, SwectlError, msgspec.DecodeError, msgspec.ValidationError):
            continue
        if past.name == recipe.name and wanted <= set(records):
            return records, folder
    return None


def expected_s(recipe: Recipe, sizes: dict[str, float], past: dict[str, PhaseRecord]) -> dict[str, float]:
    """An earlier run's seconds per phase scaled to this one by the phases' sizes."""
    return {p.name: past[p.name].seconds * sizes[p.name] / max(past[p.name].size, 1e-9) for p in recipe.file.phase}


def finish_times(recipe: Recipe, seconds: dict[str, float]) -> dict[str, float]:
    """When each phase would end from the start, each starting once those it waits for have ended."""
    ends: dict[str, float] = {}
    for phase in recipe.file.phase:
        ends[phase.name] = max((ends[a] for a in phase.after), default=0.0) + seconds[phase.name]
    return ends


def seconds_left(recipe: Recipe, expected: dict[str, float], done: set[str]) -> float:
    """Expected seconds until every phase has ended, given the phases ``done`` (critical path over the rest)."""
    remaining = {name: (0.0 if name in done else s) for name, s in expected.items()}
    return max(finish_times(recipe, remaining).values(), default=0.0)


class RunLog:
    """Says a line and adds it, timestamped and labelled, to a run's swectl.log."""

    def __init__(self, path: Path, say: Callable[[str], None], label: str) -> None:
        self.path = path
        self.say = say
        self.label = label

    def __call__(self, line: str) -> None:
        self.say(line)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.label}: {line}\n")


def train_speed(run_dir: Path) -> tuple[float, float]:
    """A training run's median seconds a step and training tokens a second (its metrics.jsonl); zeros when unknown."""
    from swectl.actors.metrics import METRICS_FILE, read_metrics

    try:
        records, _ = read_metrics(run_dir / METRICS_FILE)
    except OSError:
        return 0.0, 0.0
    timed = [r for r in records if isinstance(r.get("step_s"), float | int) and
             isinstance(r.get("train_tokens_per_s"), float | int)]
    if not timed:
        return 0.0, 0.0
    return (round(statistics.median(float(r["step_s"]) for r in timed), 3),
            round(statistics.median(float(r["train_tokens_per_s"]) for r in timed), 1))
