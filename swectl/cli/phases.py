"""A recipe's phases run (swectl/train/recipe.py says what a recipe is): one event loop, each phase awaiting the driver
its swectl command calls, inside this process; phases whose ``after`` have finished run at once, siblings in one task
group. The trainer and the engines keep their processes (torchrun ranks, engine servers), as under the commands.

Each phase logs the command line it is (what a user would type to run it alone), runs in a run-files scope of its own
(its swectl.log takes its records only) and, when its ``output`` is ``log``, prints into ``NAME.log`` in the run
folder instead of the terminal (one terminal holds one progress line). A finished phase is recorded in phases.json
and kept when the run is resumed (`swectl up --resume RUN`); an unfinished train phase resumes from its last
checkpoint, any other starts again in an empty folder. A failed phase stops the run (its siblings are cancelled) and
says where to go on from; an ``optional`` one is said and the run goes on.
"""

from __future__ import annotations

import argparse
import math
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec

from swectl import logs
from swectl.config import ClusterConfig, override_text
from swectl.errors import ConfigError, SwectlError
from swectl.train.recipe import (
    LOG_FILE,
    PHASES_FILE,
    RECIPE_FILE,
    SUMMARY_FILE,
    Phase,
    PhaseRecord,
    Reading,
    Recipe,
    RunLog,
    Summary,
    arg_flags,
    expected_s,
    leaves,
    names_for,
    overlay,
    previous_run,
    read_records,
    seconds_left,
    set_flags,
    size,
    train_speed,
    write_records,
)

Say = Callable[[str], None]
POSITIONAL = {"plot": ("run_dir",), "judge-data": ("runs",)}  # args that are the command's positionals, by kind
JUDGE_DATA_FILE = "judge.jsonl"  # what a judge-data phase writes in its folder


class PhaseCommand(msgspec.Struct, frozen=True, kw_only=True):
    """A phase as a swectl command: its command line as the log shows it (the recipe's overlay as ``--set`` flags:
    the same run when copied), what its driver is given (``flags``: the command's own flags and the user's
    ``--set``s, parsed by swectl's own parser; a train phase has none), and the config as values: the recipe's
    overlay (a train phase's with out_dir and run_id), then the user's ``--set``s."""

    argv: list[str]
    flags: list[str] = []
    overlay: dict[str, Any] = {}
    user_sets: list[str] = []  # KEY=VALUE
    size: float = 1.0

    def config(self, base: str | None) -> ClusterConfig:
        """A train phase's config (the recipe's base file or the embedded default, then its overlay, then the
        user's sets), checked as `swectl up` checks one."""
        from swectl.cli.common import load_run_config

        return load_run_config(base, self.user_sets, self.overlay)


def command_of(recipe: Recipe, phase: Phase, run_dir: Path, names: dict[str, Any], user_sets: list[str]
               ) -> PhaseCommand:
    """The swectl command line ``phase`` is, with ``names`` filled in and the user's ``--set``s last (they win)."""
    from swectl.train.recipe import fill

    folder = phase.path(run_dir)
    args = fill(phase.args, names, f"{phase.name}.args")
    document = overlay(recipe, phase, names)
    base = [recipe.file.base] if recipe.file.base else []
    user = [x for s in user_sets for x in ("--set", s)]
    if phase.kind in ("data", "eval"):  # the overlay by value; the logged line shows it as --sets
        head = ["data", "gold"] if phase.kind == "data" else ["eval"]
        flags = [*head, *base, *arg_flags(args), "--out", str(folder)]
        return PhaseCommand(argv=[*flags, *set_flags(document), *user], flags=[*flags, *user], overlay=document,
                            user_sets=list(user_sets),
                            size=size({**document, "rollout": {**document.get("rollout", {}), **_samples(args)}}))
    match phase.kind:
        case "model":
            argv = ["model", "init", "--out", str(folder), *arg_flags(args)]
        case "judge-data":  # reads recorded episodes: no config
            argv = ["data", "judge", *_positionals(args, "judge-data"), *arg_flags(args), "--out",
                    str(folder / JUDGE_DATA_FILE)]
        case "plot":
            argv = ["plot", *_positionals(args, "plot"), *arg_flags(args)]
        case "train":
            placed = {"out_dir": str(folder.parent), "run_id": folder.name, **document}
            shown = [*(override_text(k, v) for k, v in leaves(placed)), *user_sets]  # the equivalent command
            argv = ["up", *(base or ["--recipe", "train"]), *[x for s in shown for x in ("--set", s)]]
            return PhaseCommand(argv=argv, overlay=placed, user_sets=list(user_sets), size=size(document))
    return PhaseCommand(argv=argv, flags=argv, size=size(document))


def _positionals(args: dict[str, Any], kind: str) -> list[str]:
    """The kind's positional arguments taken out of ``args`` (a list gives one argument per item)."""
    out: list[str] = []
    for key in POSITIONAL[kind]:
        value = args.pop(key, [])
        out += [str(v) for v in (value if isinstance(value, list) else [value])]
    return out


def _samples(args: dict[str, Any]) -> dict[str, Any]:
    return {"samples": args["samples"]} if isinstance(args.get("samples"), int) else {}


def _parse(argv: list[str]) -> argparse.Namespace:
    from swectl.cli.main import build_parser

    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse said what is wrong on stderr
        raise ConfigError(f"swectl {shlex.join(argv)}: not a command line swectl takes (exit {exc.code})") from None


def check(recipe: Recipe, run_dir: Path, user_sets: list[str]) -> dict[str, PhaseCommand]:
    """Every phase's command line built and checked before any phase runs: its flags parse, and its config (the
    recipe's overlays and the user's ``--set``s) decodes and passes the config's checks. Phases not run yet stand in
    for their outputs by where they will be."""
    from swectl.cli.common import load_run_config
    from swectl.cli.eval import rollout_overrides

    commands: dict[str, PhaseCommand] = {}
    base = recipe.file.base or None
    for phase in recipe.file.phase:
        command = command_of(recipe, phase, run_dir, names_for(recipe, run_dir, {}, phase), user_sets)
        if phase.kind == "train":
            command.config(base)
        else:
            args = _parse(command.flags)
            if phase.kind in ("data", "eval"):
                load_run_config(base, [*args.overrides, *(rollout_overrides(args) if phase.kind == "eval" else [])],
                                command.overlay)
        commands[phase.name] = command
    return commands


# ---------------------------------------------------------------- the run


async def run_recipe(recipe: Recipe, run_dir: Path, user_sets: list[str], say: Say) -> Summary:
    """Every phase of ``recipe`` in ``run_dir`` (the finished ones kept); the summary, also written. A failed phase
    stops the run with its error and where to go on from."""
    try:
        return await _run(recipe, run_dir, user_sets, say)
    except SwectlError as exc:
        raise type(exc)(f"{exc}; the phases that finished are kept in {run_dir}: go on with "
                        f"`swectl up --resume {run_dir}`") from exc


async def _run(recipe: Recipe, run_dir: Path, user_sets: list[str], say: Say) -> Summary:
    commands = check(recipe, run_dir, user_sets)  # a wrong key, value or flag stops here, before any phase
    resumed = _record_recipe(recipe, run_dir)
    log = RunLog(run_dir / LOG_FILE, say, "recipe")
    records = read_records(run_dir)
    if resumed:
        log(f"resuming {run_dir}: {len(records)} finished phases are kept")
    started = time.monotonic()
    sizes = {name: command.size for name, command in commands.items()}
    past = previous_run(run_dir.parent, recipe, run_dir)
    expected = expected_s(recipe, sizes, past[0]) if past is not None else None
    if past is not None:
        log(f"time left: estimated from the run in {past[1]}, scaled to this recipe's numbers")
    await _split(recipe, run_dir, log)
    done: set[str] = set(records)
    total = len(recipe.file.phase)

    def phase_line(index: int, phase: Phase, about: str) -> None:
        spent = time.monotonic() - started
        if expected is None:
            log(f"[{index + 1}/{total}] {phase.name}: {about} (elapsed {spent / 60:.1f} min; no earlier run of "
                f"recipe {recipe.name} in {run_dir.parent} to estimate the time left from)")
            return
        expected_spent = seconds_left(recipe, expected, set()) - seconds_left(recipe, expected, done)
        scale = spent / expected_spent if expected_spent > 0 and spent > 60 else 1.0
        left = seconds_left(recipe, expected, done) * scale
        log(f"[{index + 1}/{total}] {phase.name}: {about} (elapsed {spent / 60:.1f} min, about {left / 60:.0f} min "
            "left)")

    finished = {phase.name: anyio.Event() for phase in recipe.file.phase}

    async def one(index: int, phase: Phase) -> None:
        for before in phase.after:
            await finished[before].wait()
        if phase.name in records:
            finished[phase.name].set()
            return
        names = names_for(recipe, run_dir, records, phase)
        from swectl.train.recipe import fill

        phase_line(index, phase, str(fill(phase.about, names, f"{phase.name}.about")) or phase.kind)
        command = command_of(recipe, phase, run_dir, names, user_sets)
        try:
            record = await _run_phase(recipe, phase, command, run_dir, log)
        except SwectlError as exc:
            if not phase.optional:
                raise
            log(f"{phase.name}: {exc} (optional: the run goes on)")
        else:
            records[phase.name] = record
            write_records(run_dir, records)
        done.add(phase.name)
        finished[phase.name].set()

    async with anyio.create_task_group() as tg:
        for index, phase in enumerate(recipe.file.phase):
            tg.start_soon(one, index, phase, name=f"phase {phase.name}")
    summary = _summary(recipe, run_dir, records, time.monotonic() - started)
    (run_dir / SUMMARY_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
    for line in summary_table(recipe, summary):
        log(line)
    return summary


def _record_recipe(recipe: Recipe, run_dir: Path) -> bool:
    """The run folder made, with the recipe it runs in recipe.json; whether it had one (a resumed run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    resumed = (run_dir / RECIPE_FILE).exists()
    (run_dir / RECIPE_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(recipe)) + b"\n")
    return resumed


def _phase_folder(phase: Phase, run_dir: Path) -> tuple[Path, bool]:
    """The phase's folder, emptied unless it is a train phase with a checkpoint to resume from (the second value)
    or the run folder itself: an interrupted phase's partial output would be refused."""
    folder = phase.path(run_dir)
    resume = phase.kind == "train" and (folder / "checkpoints" / "latest").exists()
    if folder.resolve() != run_dir.resolve() and folder.exists() and not resume:
        shutil.rmtree(folder)
    return folder, resume


async def _split(recipe: Recipe, run_dir: Path, log: Say) -> None:
    """The recipe's train / held-out split, made once (off the event loop: Harbor tasks build images): kept when the
    run folder has it. The record is the same split.json that `swectl up` writes (swectl/train/split.py)."""
    spec = recipe.file.split
    if spec is None or all((run_dir / f"{name}.jsonl").is_file() for name in ("train", "test")):
        return
    from swectl.images.project import BUNDLED_TASKS
    from swectl.train.recipe import fill
    from swectl.train.split import SPLIT_FILE, record_split, split_source_off_loop

    names = names_for(recipe, run_dir, {}, recipe.file.phase[0])
    source = str(fill(spec.tasks, names, "split.tasks")) or str(BUNDLED_TASKS)
    fraction, seed = fill(spec.test_fraction, names, "split.test_fraction"), fill(spec.seed, names, "split.seed")
    split = await split_source_off_loop(source, fraction, seed, key="split.tasks", say=log)
    if not split.train or (fraction and not split.held_out):  # test_fraction 0: nothing held out, on purpose
        raise ConfigError(f"split.test_fraction {fraction}: {len(split.train)} train and {len(split.held_out)} "
                          f"held-out tasks of {len(split.train) + len(split.held_out)}; both splits need one "
                          "(test_fraction = 0 holds none out)")
    record_split(run_dir / SPLIT_FILE, split.record, settings="split.tasks, split.test_fraction or split.seed")
    for name, tasks in (("train", split.train), ("test", split.held_out)):
        (run_dir / f"{name}.jsonl").write_bytes(b"".join(msgspec.json.encode(t.row()) + b"\n" for t in tasks))
    log(f"{len(split.train)} train / {len(split.held_out)} held-out tasks of {source} (split seed {seed})")


async def _run_phase(recipe: Recipe, phase: Phase, command: PhaseCommand, run_dir: Path, log: Say) -> PhaseRecord:
    """One phase run by its command's driver; its record."""
    from swectl.train.checkpoint import latest_checkpoint

    folder, resume = _phase_folder(phase, run_dir)
    beside = phase.output == "log"
    where = f"beside; output in {run_dir / (phase.name + '.log')}" if beside else "in this process"
    log(f"{phase.name}: swectl {shlex.join(command.argv)} ({where}" + (", resuming from its checkpoint)"
                                                                      if resume else ")"))
    started = time.monotonic()
    if beside:
        with (run_dir / f"{phase.name}.log").open("w", encoding="utf-8") as out, logs.output_to(out):
            code = await _drive(recipe, phase, command, folder, resume, log)
    else:
        code = await _drive(recipe, phase, command, folder, resume, log)
    if code != 0:
        tail = ""
        if beside:
            tail = "; the end of its log:\n" + (run_dir / f"{phase.name}.log").read_text(errors="replace")[-2000:]
        raise SwectlError(f"phase {phase.name} failed (exit {code}){tail}")
    weights = ""
    if phase.kind == "train":
        latest = latest_checkpoint(folder)
        if latest is None:
            raise SwectlError(f"phase {phase.name}: {folder} ended without a checkpoint")
        weights = latest[1].weights
    return PhaseRecord(seconds=round(time.monotonic() - started, 1), argv=command.argv, size=command.size,
                       weights=weights)


async def _drive(recipe: Recipe, phase: Phase, command: PhaseCommand, folder: Path, resume: bool, log: Say) -> int:
    """The phase awaited by the driver its command calls, in a run-files scope of its own."""
    from swectl.cli.common import say

    with logs.run_files_scope():
        if phase.kind == "train":
            from swectl.cli.up import train

            await train(command.config(recipe.file.base or None), folder, resume=resume, say=say)
            return 0
        args = _parse(command.flags)
        args.config_overlay = command.overlay or None  # data and eval: the overlay as values
        if phase.kind == "eval":
            from swectl.cli.eval import drive

            return await drive(args)
        if phase.kind == "data":
            from swectl.cli.data import gold

            return await gold(args)
        from swectl.cli.main import command_module

        run = command_module(args.command).run  # model init, data judge and plot: sync drivers, in a worker thread
        return await anyio.to_thread.run_sync(run, args)


# ---------------------------------------------------------------- the report


def reading(folder: Path) -> Reading:
    """A finished eval phase's reading (its summary.json, as eval's AgentSummary)."""
    from swectl.eval.agents import AgentSummary

    path = folder / "summary.json"
    try:
        summary = msgspec.json.decode(path.read_bytes(), type=AgentSummary)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SwectlError(f"{path}: not a finished `swectl eval` reading ({exc}); delete {folder} and "
                          f"{folder.parent / PHASES_FILE}'s entry for it to take it again") from exc
    return Reading(resolve_rate=summary.resolve_rate, resolved=summary.resolved, episodes=summary.finished,
                   aborted=summary.infra_errors, folder=str(folder), model=summary.settings.model,
                   seed=summary.settings.rollout.seed)


def noise_points(a: Reading, b: Reading) -> float:
    """One standard error of reading ``b``'s resolve rate minus reading ``a``'s, in points (two independent binomial
    readings)."""
    var = sum(r.resolve_rate * (1 - r.resolve_rate) / max(r.episodes, 1) for r in (a, b))
    return round(100 * math.sqrt(var), 1)


def outcomes(folder: Path) -> dict[tuple[str, int], bool]:
    """A finished reading's scored episodes (aborted ones left out, as its resolve rate leaves them): resolved or not,
    by task and sample."""
    from swectl.eval.agents import read_results

    return {(r.instance_id, r.sample): r.resolved for r in read_results(folder) if r.outcome != "ABORTED"}


def paired_noise_points(a: Reading, b: Reading) -> float | None:
    """One standard error of ``b`` minus ``a`` from their differences episode by episode, when the two readings are
    paired: the same tasks and samples under the same sampling seed (each request of sample k of a task draws the same
    random numbers in both), so a task both policies solve, or neither, adds no noise. The standard deviation is over
    every pair, so differences between tasks count as noise too (the conservative side of a stratified estimate).
    None when the readings are not paired (another seed, other tasks or samples, an episode aborted in one)."""
    if a.seed != b.seed:
        return None
    first, second = outcomes(Path(a.folder)), outcomes(Path(b.folder))
    if len(first) < 2 or set(first) != set(second):
        return None
    diffs = [int(second[k]) - int(first[k]) for k in first]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)
    return round(100 * math.sqrt(var / len(diffs)), 1)


def _summary(recipe: Recipe, run_dir: Path, records: dict[str, PhaseRecord], seconds: float) -> Summary:
    report = recipe.file.report
    readings = {spec.name: reading(recipe.phase(spec.phase).path(run_dir)) for spec in (report.reading if report
                                                                                        else [])}
    gain, noise, paired = _gain(readings, report.gain if report else [])
    control, control_noise, control_paired = _gain(readings, report.control if report else [])
    step_s, tokens_per_s = (train_speed(recipe.phase(report.speed).path(run_dir))
                            if report is not None and report.speed else (0.0, 0.0))
    seed = recipe.vars.get("seed")
    return Summary(recipe=recipe.name, seed=seed if isinstance(seed, int) else None, readings=readings,
                   gain_points=gain, gain_noise_points=noise, minutes=round(seconds / 60, 1),
                   phases_s={name: r.seconds for name, r in records.items()}, run_dir=str(run_dir),
                   vars=recipe.vars, sft_step_s=step_s, sft_tokens_per_s=tokens_per_s, control_gain_points=control,
                   control_noise_points=control_noise, gain_paired=paired, control_paired=control_paired)


def _gain(readings: dict[str, Reading], pair: list[str]) -> tuple[float | None, float | None, bool]:
    """Reading ``pair[1]`` minus reading ``pair[0]`` in points, one standard error of it (paired episode by episode
    where the readings are), and whether it is paired; Nones with no pair."""
    if not pair:
        return None, None, False
    before, after = readings[pair[0]], readings[pair[1]]
    paired = paired_noise_points(before, after)
    return (round(100 * (after.resolve_rate - before.resolve_rate), 1),
            paired if paired is not None else noise_points(before, after), paired is not None)


def summary_table(recipe: Recipe, s: Summary) -> list[str]:
    """The lines a recipe run ends with."""
    report = recipe.file.report
    run = Path(s.run_dir)
    seed = f" (seed {s.seed})" if s.seed is not None else ""
    lines = ["", f"{recipe.name} {run}: {s.minutes} min{seed}"]
    if report is not None and report.reading:
        lines.append("  sampled resolve rate")
        for spec in report.reading:
            r = s.readings[spec.name]
            lines.append(f"  {spec.label or spec.name:<28} {100 * r.resolve_rate:5.1f}%  ({r.resolved}/{r.episodes} "
                         "episodes)")
    if s.gain_points is not None:
        lines.append(f"  {report.gain_label if report else 'gain'}: {s.gain_points:+.1f} points (one standard error "
                     f"{s.gain_noise_points:.1f}{', paired by task and sample' if s.gain_paired else ''})")
    if s.control_gain_points is not None:
        lines.append(f"  {report.control_label if report else 'control'}: {s.control_gain_points:+.1f} points (one "
                     f"standard error {s.control_noise_points:.1f}{', paired' if s.control_paired else ''})")
    lines.append("  minutes per phase: " + ", ".join(f"{k} {round(v / 60, 1)}" for k, v in s.phases_s.items()))
    if report is not None and report.note:
        lines.append(f"  ({report.note})")
    if s.sft_step_s:
        lines.append(f"  machine speed: {report.speed if report else 'training'} took {s.sft_step_s:.2f} s a step "
                     f"({s.sft_tokens_per_s / 1000:.1f}k tokens/s); the minutes scale with it")
    trains = [p for p in recipe.trains if p.path(run) != run]
    lines.append(f"  run folder {run}: summary.json, phases.json, " + ", ".join(f"{p.folder or p.name}/"
                                                                              for p in recipe.file.phase
                                                                              if p.path(run) != run))
    if trains:
        last = trains[-1].path(run)
        lines.append(f"  look at it: swectl view {last}   curves: swectl plot {last}")
    return [*lines, ""]
