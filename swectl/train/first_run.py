"""The first run's phases as code: what benchmarks/ (hack, learn_harness, chaos) and experiments/ (learn, prm) still
call. `swectl up` with no config file runs the recipe file swectl/data/bundled/recipes/first-run.toml instead
(swectl/train/recipe.py, swectl/cli/phases.py), whose settings tests/test_recipe.py checks equal these; this module
goes once those callers move onto recipes (issue 57). Its training runs are `swectl up --recipe train` subprocesses.

The text below is how the first run worked as code (the recipe file keeps its phases and numbers):

A user of this field on a laptop runs: a small policy, supervised data from a teacher, SFT, then GRPO from the
SFT weights, then sampled readings of the policy on the train split and on the held-out split. Each phase is one
swectl command (the same commands a user would type, said as it starts), run in order in one run folder: inside this
process by the driver that command line names (`swectl up` passes swectl.cli.main.run_in_process), except the
phases that run beside another (the SFT reading beside GRPO, the held-out reading and the plot beside the GRPO
reading), which are subprocesses with their output in a log of their own:

1. ``model/``: the tiny Qwen3 (`swectl model init --seed SEED`); ``train.jsonl`` / ``test.jsonl``: the seeded
   split of the bundled tasks (the split `swectl up` makes with train.data.split_seed = SEED);
2. SFT data on the train split (`swectl data gold`): each task's gold patch acted out as agent turns (``gold/``)
   and a noisy teacher: ``give_up`` copies of a trajectory that looks at the code and submits no change
   (``give-up/``) and ``recover`` copies of one that slips (malformed replies, masked in SFT) and recovers
   (``recover/``). The SFT policy imitates a teacher that is right one time in ``1 + give_up``: only the reward
   says which of its attempts are right, which is what GRPO then learns from;
3. SFT (``sft/``, `swectl up` with train.algorithm = "sft");
4. a sampled reading (temperature 1, seeded) of the SFT policy on the train split (``eval-sft/``);
5. GRPO from the SFT weights (``grpo/``) with a KL anchor to them and a cosine learning rate;
6. the same reading of the GRPO policy (``eval-grpo/``), and one on the held-out split (``eval-test/``).

Every phase that finished is kept: the run resumed (`swectl up --resume RUN`) starts at the first phase that did
not. ``summary.json`` holds the readings, the gain and the minutes; the table is printed and added to
``swectl.log``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from swectl.config import TRUNCATED_ENDINGS
from swectl.errors import ConfigError, SwectlError
from swectl.train.checkpoint import latest_checkpoint
from swectl.train.recipe import RunLog, train_speed

SWECTL = [sys.executable, "-m", "swectl.cli.main"]
RECIPE_FILE = "recipe.json"
SUMMARY_FILE = "summary.json"
LOG_FILE = "swectl.log"
OVERLONG_ENDINGS = [e for e in TRUNCATED_ENDINGS if e != "FormatError"]  # the TRUNCATED endings but FormatError
Say = Callable[[str], None]
# runs one swectl command line inside this process and returns its exit status (swectl.cli.main.run_in_process,
# passed in by `swectl up`); None: the command runs as a subprocess (the benchmarks' way)
Runner = Callable[[list[str]], int] | None


class Recipe(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The first run's numbers (`swectl up --set recipe.KEY=VALUE`; `just learn` flags of the same names)."""

    seed: int = 0  # the model's init, the task split, SFT, GRPO and the readings' sampling
    tasks: str = ""  # the task file to split ("": the bundled tasks)
    test_fraction: float = 0.5  # share of the bundled tasks held out
    give_up: int = 1  # copies per task of the teacher that submits no change (0: SFT on gold only)
    recover: int = 1  # copies per task of the teacher that slips and recovers
    # the tiny model must nearly memorise the edits (docs/results.md, "2026-11-28 — `swectl up` with no config file")
    sft_steps: int = 400
    sft_batch_size: int = 8
    sft_lr: float = 2e-3
    sft_schedule: Literal["constant", "cosine"] = "constant"
    # 30 took longer for no more gain (docs/results.md, "2026-11-29 — the first run in 25 to 27 minutes")
    grpo_steps: int = 20
    grpo_lr: float = 2e-4
    grpo_schedule: Literal["constant", "cosine"] = "cosine"  # cosine: down to a tenth by the last step
    kl_coef: float = 0.5  # GRPO's KL penalty to the SFT weights (low_var_kl): keeps the SFT format
    # GRPO: a task whose group had equal rewards is passed over once (train.sampling.pass_over_uninformative;
    # synchronous GRPO only: with recipe.max_staleness=0)
    pass_over: bool = False
    tasks_per_step: int = 4
    n_samples: int = 4  # GRPO group size
    step_limit: int = 6  # agent turns per episode, in training and in the readings
    max_tokens: int = 192  # generated tokens per turn
    max_format_errors: int = 3  # malformed replies in a row that end an episode
    context: int = 8192  # context budget in tokens of every episode
    # the agent's prompts (rollout.agent_config): "compact" says the protocol in 85 tokens instead of 275; the tiny
    # model learns it from the teacher's data either way, and every token of prompt is paid for in SFT, rollouts and
    # readings ("": the built-in prompt)
    agent_config: str = "compact"
    manage_context: bool = False  # head+tail context management when an episode outgrows `context`
    mask_truncated: bool = True  # GRPO: truncated episodes (step limit, malformed replies) carry no gradient
    mask_truncated_endings: Literal["all", "overlong"] = "all"  # overlong: not the malformed-reply limit
    mask_format_errors: bool = True  # GRPO: malformed replies carry no gradient
    # episodes at a time, in training and in the readings; the engine decodes that many rows together (16 rather than
    # 8: docs/results.md, "2026-11-29 (night) — the first run with its independent phases at once")
    concurrency: int = 16
    # GRPO: how many steps a group's weights may lag the trainer's (train.sampling.max_staleness; 0: synchronous).
    # At 1 the next step's rollouts run while the trainer trains, instead of the engine idling through each training
    # step and the trainer through each step's rollouts: faster, and within noise of synchronous GRPO's gain on
    # three seeds (docs/results.md, "2026-11-29 (late) — the first run with asynchronous GRPO")
    max_staleness: int = 1
    # torch threads of the SFT trainer, one rank (0: this machine's cores). SFT trains while nothing else runs, and
    # one rank of every core beat two ranks of half (docs/results.md, "2026-11-29 — the first run in 25 to 27 minutes")
    trainer_threads: int = 0
    # torch threads of the GRPO trainer (0: 1 when asynchronous, else this machine's cores). Asynchronous GRPO trains
    # beside its rollouts, and more threads fought the engine for the cores; synchronous GRPO trains alone
    # (docs/results.md, "2026-11-29 (late) — the first run with asynchronous GRPO")
    grpo_trainer_threads: int = 0
    eval_samples: int = 4  # episodes per train task in each reading
    test_samples: int = 2  # episodes per held-out task
    eval_seed: int | None = None  # sampling seed of the readings (default: seed)

    def rollout_sets(self) -> dict[str, object]:
        return {"rollout.step_limit": self.step_limit, "rollout.max_tokens": self.max_tokens,
                "rollout.max_format_errors": self.max_format_errors, "env_pool.warm": 0,
                "rollout.context": self.context, "rollout.manage_context": str(self.manage_context).lower(),
                "rollout.agent_config": json.dumps(self.agent_config)}

    def engine_sets(self) -> dict[str, object]:
        return {"engine.max_batch": self.concurrency}

    @staticmethod
    def trainer_sets(threads: int) -> dict[str, object]:
        return {"trainer.nproc_per_node": 1, "trainer.threads_per_rank": threads or os.cpu_count() or 1}

    def sft_sets(self, model: Path, sft_data: list[str]) -> dict[str, object]:
        return {**self.trainer_sets(self.trainer_threads), "train.model": repr(str(model)), "train.algorithm": '"sft"',
                "train.data.sft_data": json.dumps(sft_data),
                "train.data.sft_resolved_only": str(not self.give_up).lower(), "train.steps": self.sft_steps,
                "train.data.sft_batch_size": self.sft_batch_size, "train.optim.lr": self.sft_lr,
                "train.optim.warmup_steps": min(3, self.sft_steps - 1),
                "train.optim.schedule": f'"{self.sft_schedule}"', "train.seed": self.seed,
                "train.save_every": self.sft_steps}

    def grpo_sets(self, sft_weights: Path, train_tasks: Path | None = None) -> dict[str, object]:
        """GRPO's settings from ``sft_weights``. ``train_tasks``: the train split the run folder recorded
        (``train.jsonl``), trained on whole (test_fraction 0), so the split is made once; None: GRPO makes the same
        seeded split of ``tasks`` itself (the benchmarks that run GRPO without a first run's folder)."""
        endings = OVERLONG_ENDINGS if self.mask_truncated_endings == "overlong" else [*OVERLONG_ENDINGS, "FormatError"]
        threads = self.grpo_trainer_threads or (1 if self.max_staleness else 0)
        return {**self.trainer_sets(threads), **self.engine_sets(),
                "train.model": repr(str(sft_weights)),
                "train.algorithm": '"grpo"',
                "train.steps": self.grpo_steps,
                "train.optim.lr": self.grpo_lr, "train.optim.schedule": f'"{self.grpo_schedule}"',
                "train.sampling.tasks_per_step": self.tasks_per_step, "train.sampling.n_samples": self.n_samples,
                "train.seed": self.seed, "train.data.split_seed": self.seed, "train.save_every": 5,
                **({"train.data.tasks": repr(str(train_tasks)), "train.data.test_fraction": 0.0}
                   if train_tasks is not None else
                   {"train.data.test_fraction": self.test_fraction,
                    **({"train.data.tasks": repr(self.tasks)} if self.tasks else {})}),
                "train.concurrency": self.concurrency, "train.sampling.max_sampling_rounds": 2,
                "train.sampling.max_staleness": self.max_staleness,
                "train.sampling.pass_over_uninformative": str(self.pass_over).lower(),
                "train.loss.mask_truncated": str(self.mask_truncated).lower(),
                "train.loss.mask_truncated_endings": json.dumps(endings),
                "train.loss.mask_format_errors": str(self.mask_format_errors).lower(),
                "train.loss.kl_coef": self.kl_coef}

    @property
    def reading_seed(self) -> int:
        return self.seed if self.eval_seed is None else self.eval_seed


def overrides(sets: dict[str, object]) -> list[str]:
    """``KEY=VALUE`` config overrides, one per entry (what ``load_config`` and ``--set`` take)."""
    return [f"{k}={v}" for k, v in sets.items()]


def set_flags(sets: dict[str, object]) -> list[str]:
    """``--set KEY=VALUE`` arguments, one pair per entry."""
    return [x for override in overrides(sets) for x in ("--set", override)]


def swectl(argv: list[str], what: str, say: Say, runner: Runner = None) -> float:
    """Run one swectl command (its output goes to this terminal): inside this process by ``runner``, else as a
    subprocess; the seconds it took. A failure stops the run (the command's error, or its exit status): the phases
    before it stay in the run folder."""
    say(f"{what}: swectl {' '.join(argv)}" + (" (in this process)" if runner is not None else ""))
    t0 = time.monotonic()
    code = runner(argv) if runner is not None else subprocess.run([*SWECTL, *argv], check=False).returncode
    if code == 130:
        raise KeyboardInterrupt
    if code != 0:
        raise SwectlError(f"{what} failed (exit {code})")
    return time.monotonic() - t0


class Beside:
    """One swectl command run beside the caller's work (``with Beside(...) as job:``), its output into ``log``
    rather than this terminal (one terminal holds one progress bar). Leaving the block waits for the command and
    raises SwectlError, with the log's tail, when it failed; an exception inside the block (Ctrl-C included) stops
    the command first. ``seconds``: how long the command itself took. ``argv`` None (the phase is already done)
    runs nothing. Two CPU-bound phases overlap well on a 2-core machine because each leaves part of it idle (an
    engine waits on its episodes' commands: docs/results.md, "2026-11-29 (night) — the first run with its
    independent phases at once")."""

    def __init__(self, argv: list[str] | None, what: str, log: Path, say: Say) -> None:
        self.argv, self.what, self.log, self.say = argv, what, log, say
        self.seconds = 0.0
        self._proc: subprocess.Popen[bytes] | None = None
        self._waiter: threading.Thread | None = None

    def __enter__(self) -> Beside:
        if self.argv is None:
            return self
        self.say(f"{self.what} (beside; output in {self.log}): swectl {' '.join(self.argv)}")
        started = time.monotonic()
        with self.log.open("wb") as out:
            self._proc = subprocess.Popen([*SWECTL, *self.argv], stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        proc = self._proc

        def wait() -> None:
            proc.wait()
            self.seconds = time.monotonic() - started

        self._waiter = threading.Thread(target=wait, name=f"beside {self.what}", daemon=True)
        self._waiter.start()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._proc is None or self._waiter is None:  # nothing was run
            return
        if exc_type is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._waiter.join()
        if exc_type is not None:
            return
        if self._proc.returncode == 130:
            raise KeyboardInterrupt
        if self._proc.returncode != 0:
            tail = self.log.read_text(encoding="utf-8", errors="replace")[-2000:]
            raise SwectlError(f"{self.what} failed (exit {self._proc.returncode}); the end of {self.log}:\n{tail}")


def make_model(work: Path, seed: int, say: Say) -> Path:
    """The tiny model in ``work/model``, made in this process by the driver `swectl model init` calls (the phase
    says that command line)."""
    from swectl.model.tiny import ModelInitConfig, init_model

    model = work / "model"
    if not (model / "config.json").exists():
        say(f"model: swectl model init --out {model} --seed {seed} (in this process)")
        init_model(model, ModelInitConfig(seed=seed), progress=say)
    return model


def write_split(work: Path, recipe: Recipe) -> tuple[list[Any], list[Any]]:
    """The seeded train / held-out split of the bundled tasks, written to ``train.jsonl`` and ``test.jsonl``."""
    from swectl.actors.data_source import split_tasks
    from swectl.images.harbor import with_harbor_prepared
    from swectl.images.project import BUNDLED_TASKS
    from swectl.tasks.sources import load_tasks

    source = recipe.tasks or str(BUNDLED_TASKS)
    loaded = with_harbor_prepared(load_tasks(source))  # Harbor task folders: images built, gold patches made
    if not loaded.tasks:
        raise ConfigError(f"recipe.tasks {source}: no usable task in it")
    train, test = split_tasks(loaded.tasks, recipe.test_fraction, recipe.seed)
    if not train or not test:
        raise ConfigError(f"recipe.test_fraction {recipe.test_fraction}: {len(train)} train and {len(test)} held-out "
                          f"tasks of {len(loaded.tasks)}; both splits need one")
    for name, tasks in (("train", train), ("test", test)):
        (work / f"{name}.jsonl").write_bytes(b"".join(msgspec.json.encode(t.row()) + b"\n" for t in tasks))
    return train, test


def scripted_data_argv(work: Path, model: Path, recipe: Recipe, scripts: Sequence[str], extra: Sequence[str] = ()
                       ) -> list[str] | None:
    """`swectl data gold` with a ``--script`` each for ``scripts`` on the train split, each into ``work/SCRIPT``
    (``extra``: more arguments, the user's ``--set``s); None when those folders are all made."""
    missing = [script for script in scripts if not (work / script / "summary.json").exists()]
    if not missing:
        return None
    for script in missing:  # an interrupted run's partial results would be refused: made anew
        shutil.rmtree(work / script, ignore_errors=True)
    chosen = [flag for script in missing for flag in ("--script", script)]
    out = work / missing[0] if len(missing) == 1 else work
    return ["data", "gold", *chosen, "--tasks", str(work / "train.jsonl"), "--model", str(model),
            "--out", str(out), "--concurrency", "4", *set_flags(recipe.rollout_sets()), *extra]


def sft_data(work: Path, model: Path, recipe: Recipe, say: Say, extra: Sequence[str] = (), runner: Runner = None
             ) -> list[str]:
    """The SFT data folders: gold, then the noisy teacher's copies (a folder listed K times is read K times). The
    scripts run at once in one process (one interpreter, one sandbox pool, and the gold patch that recover ends with
    graded once: docs/results.md, "2026-11-29 (night) — the first run in 22.2-24.0 minutes")."""
    scripts = {"gold": 1, "give-up": recipe.give_up, "recover": recipe.recover}
    if argv := scripted_data_argv(work, model, recipe, [script for script, copies in scripts.items() if copies],
                                  extra):
        swectl(argv, "SFT data", say, runner)
    return [path for script, copies in scripts.items() for path in [str(work / script)] * copies]


def eval_argv(recipe: Recipe, model: Path, tasks: Path, out: Path, samples: int, seed_offset: int = 0,
              extra: Sequence[str] = ()) -> list[str] | None:
    """`swectl eval` of ``model`` on ``tasks`` (``samples`` episodes per task, temperature 1, seeded) into
    ``out``; None when ``out`` already holds a finished reading. Two readings of one policy that are pooled take
    different ``seed_offset``s, so they are independent samples."""
    if (out / "summary.json").exists():
        return None
    return ["eval", "--model", str(model), "--tasks", str(tasks), "--samples", str(samples),
            "--seed", str(recipe.reading_seed + seed_offset), "--temperature", "1.0",
            "--step-limit", str(recipe.step_limit), "--max-tokens", str(recipe.max_tokens),
            "--concurrency", str(recipe.concurrency), "--out", str(out), "--fresh", "--set", "env_pool.warm=0",
            *set_flags(recipe.engine_sets()),
            "--set", f"rollout.agent_config={json.dumps(recipe.agent_config)}",
            "--set", f"rollout.max_format_errors={recipe.max_format_errors}", "--context", str(recipe.context),
            *(["--manage-context"] if recipe.manage_context else []), *extra]


def evaluate(recipe: Recipe, model: Path, tasks: Path, out: Path, samples: int, say: Say,
             seed_offset: int = 0, extra: Sequence[str] = (), runner: Runner = None) -> dict[str, Any]:
    """`swectl eval` of ``model`` on ``tasks`` into ``out`` (see eval_argv), once; the reading."""
    argv = eval_argv(recipe, model, tasks, out, samples, seed_offset, extra)
    if argv is not None:
        swectl(argv, f"eval {out.name}", say, runner)
    return reading(out, model)


def reading(out: Path, model: Path) -> dict[str, Any]:
    """The finished reading in ``out`` (a `swectl eval` folder) of ``model``."""
    from swectl.eval.agents import AgentSummary

    path = out / "summary.json"
    try:
        summary = msgspec.json.decode(path.read_bytes(), type=AgentSummary)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SwectlError(f"{path}: not a finished `swectl eval` reading ({exc}); delete {out} to take it again") \
            from exc
    return {"resolve_rate": summary.resolve_rate, "resolved": summary.resolved, "episodes": summary.finished,
            "aborted": summary.infra_errors, "folder": str(out), "model": str(model),
            "seed": summary.settings.rollout.seed}


def train(out_dir: Path, run_id: str, sets: dict[str, object], say: Say, *, extra: Sequence[str] = (),
          continue_from: Path | None = None, runner: Runner = None) -> Path:
    """One `swectl up` run in ``out_dir/run_id``: a new run with ``sets`` (and ``extra`` arguments), or the run
    resumed from its last checkpoint when it has one (it goes on to ``train.steps``, or stops there), or
    (``continue_from``, a finished run folder) a copy of that run resumed with ``sets`` as overrides."""
    folder = out_dir / run_id
    if continue_from is not None:
        if not folder.exists():
            shutil.copytree(continue_from, folder)
            for record in ("recipe.json", "phases.json", "summary.json"):  # resumed as the training run it holds
                (folder / record).unlink(missing_ok=True)
        argv = ["up", "--resume", str(folder), *extra, *set_flags(sets)]
    elif (folder / "checkpoints" / "latest").exists():
        argv = ["up", "--resume", str(folder), "--steps", str(sets["train.steps"])]
    else:
        argv = ["up", "--recipe", "train", "--set", f"out_dir={str(out_dir)!r}", "--set", f"run_id={run_id!r}",
                *extra, *set_flags(sets)]
    swectl(argv, f"train {run_id}", say, runner)
    return final_weights(folder)


def final_weights(run_dir: Path) -> Path:
    """The weights folder of a `swectl up` run's latest checkpoint."""
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise SwectlError(f"{run_dir}: the run ended without a checkpoint")
    return Path(latest[1].weights)


def finished_steps(run_dir: Path) -> int:
    """The steps a `swectl up` run's latest checkpoint holds (0: none)."""
    latest = latest_checkpoint(run_dir)
    return 0 if latest is None else latest[1].step


# ---------------------------------------------------------------- the run itself


class Summary(msgspec.Struct, kw_only=True):
    """``summary.json`` of a first run."""

    seed: int
    sft_train_resolve_rate: float
    grpo_train_resolve_rate: float
    test_resolve_rate: float
    gain_points: float  # GRPO's train reading minus SFT's, in percentage points
    gain_noise_points: float  # one standard error of that difference (two independent binomial readings)
    minutes: float
    phases_s: dict[str, float]
    readings: dict[str, dict[str, Any]]
    run_dir: str
    recipe: dict[str, Any]
    # The machine's speed during the run: SFT is a fixed workload per seed, and on a shared VM the same run's speed
    # moves by the hour (docs/results.md, "2026-11-29 (later) — the first run from 19.8 to 31.8 minutes on one
    # machine"), so the minutes are read beside these (median over SFT's steps)
    sft_step_s: float = 0.0
    sft_tokens_per_s: float = 0.0


PHASES = ("model and split", "SFT data", "SFT", "SFT reading", "GRPO", "GRPO reading", "held-out reading")
# Phases that run at the same time (the SFT reading beside GRPO, the held-out reading beside the GRPO reading): the
# run's minutes are the sum over these groups of their longest phase
OVERLAPPED = ((0,), (1,), (2,), (3, 4), (5, 6))
# summary.json's phases_s keys, in PHASES order
PHASE_KEYS = ("model", "sft_data", "sft", "sft_reading", "grpo", "grpo_reading", "test_reading")


class PastRun(msgspec.Struct, frozen=True):
    """What the ETA reads of an earlier first run on this machine: its summary.json's phase seconds and recipe."""

    run_dir: str
    phases_s: dict[str, float]
    recipe: dict[str, Any]


def _wall(expected: list[float], group: tuple[int, ...]) -> float:
    return max(expected[index] for index in group)


def previous_run(out_dir: Path, exclude: Path) -> tuple[list[float], Recipe, Path] | None:
    """The newest finished first run in ``out_dir`` (not ``exclude``): its seconds per phase (the overlapped ones
    beside their partner), its recipe and its folder; None when this machine has none."""
    found: list[tuple[float, Path]] = []
    for path in out_dir.glob(f"*/{SUMMARY_FILE}"):
        if path.parent.resolve() != exclude.resolve() and (path.parent / RECIPE_FILE).is_file():
            found.append((path.stat().st_mtime, path))
    for _, path in sorted(found, reverse=True):
        try:
            past = msgspec.json.decode(path.read_bytes(), type=PastRun)
            recipe = msgspec.convert(past.recipe, Recipe, strict=False)
            return [float(past.phases_s[key]) for key in PHASE_KEYS], recipe, path.parent
        except (OSError, KeyError, msgspec.DecodeError, msgspec.ValidationError):
            continue
    return None


def expected_s(recipe: Recipe, past_s: list[float], past: Recipe) -> list[float]:
    """An earlier run's seconds per phase (``past_s``, of recipe ``past``) scaled to ``recipe``: SFT by its steps x
    batch, GRPO by its steps x group, the readings by their episodes."""
    ratios = (1.0, 1.0, recipe.sft_steps * recipe.sft_batch_size / (past.sft_steps * past.sft_batch_size),
              recipe.eval_samples / past.eval_samples,
              recipe.grpo_steps * recipe.tasks_per_step * recipe.n_samples
              / (past.grpo_steps * past.tasks_per_step * past.n_samples),
              recipe.eval_samples / past.eval_samples, recipe.test_samples / past.test_samples)
    return [seconds * ratio for seconds, ratio in zip(past_s, ratios, strict=True)]


def load_recipe(run_dir: Path, overrides: dict[str, Any]) -> Recipe:
    """A resumed run's recipe (its recipe.json) or a new one, with ``recipe.KEY=VALUE`` overrides."""
    saved: dict[str, Any] = {}
    if (run_dir / RECIPE_FILE).exists():
        saved = json.loads((run_dir / RECIPE_FILE).read_text())
    try:
        return msgspec.convert({**saved, **overrides}, Recipe, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"recipe: {exc} (the keys are {', '.join(Recipe.__struct_fields__)})") from exc


def harness_sets(config_sets: list[str], say: Say) -> list[str]:
    """The user's ``--set KEY=VALUE`` flags, with ``agent.harness_config = "swectl"`` added when they name an
    external harness (``agent.harness``) and no config for it: the first run's teachers write swectl's protocol and
    the tiny model's chat template renders no tools, so the harness runs swectl's prompt in its own format
    (actors/harness.py)."""
    keys = {flag.split("=", 1)[0].strip() for flag in config_sets if flag != "--set"}
    if "agent.harness" not in keys or "agent.harness_config" in keys:
        return list(config_sets)
    say('agent.harness is set: the harness runs swectl\'s prompt in its own format (agent.harness_config = "swectl")')
    return [*config_sets, "--set", 'agent.harness_config="swectl"']


def run_first(run_dir: Path, recipe: Recipe, config_sets: list[str], say: Say, runner: Runner = None) -> Summary:
    """Every phase of the first run in ``run_dir`` (finished ones are skipped); the summary, also written. A
    failed phase stops the run with its error and where to go on from."""
    try:
        return _run_phases(run_dir, recipe, config_sets, say, runner)
    except SwectlError as exc:
        raise SwectlError(f"{exc}; the phases that finished are kept in {run_dir}: go on with "
                          f"`swectl up --resume {run_dir}`") from exc


def _run_phases(run_dir: Path, recipe: Recipe, config_sets: list[str], say: Say, runner: Runner) -> Summary:
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = run_dir / RECIPE_FILE
    resumed = saved.exists()
    saved.write_bytes(msgspec.json.format(msgspec.json.encode(recipe)) + b"\n")
    started = time.monotonic()
    phases_s: dict[str, float] = {}
    log = RunLog(run_dir / LOG_FILE, say, "first-run")

    past = previous_run(run_dir.parent, run_dir)  # the ETA: an earlier first run on this machine, scaled
    expected = expected_s(recipe, past[0], past[1]) if past is not None else None
    if past is not None:
        log(f"time left: estimated from the first run in {past[2]}, scaled to this recipe")

    def phase(index: int, detail: str) -> None:
        spent = time.monotonic() - started
        if expected is None:
            log(f"[{index + 1}/{len(PHASES)}] {PHASES[index]}: {detail} (elapsed {spent / 60:.1f} min; no earlier "
                f"first run in {run_dir.parent} to estimate the time left from)")
            return
        done = sum(_wall(expected, group) for group in OVERLAPPED if group[-1] < index)
        scale = spent / done if done and spent > 60 else 1.0
        left = sum(_wall(expected, group) for group in OVERLAPPED if group[-1] >= index) * scale
        log(f"[{index + 1}/{len(PHASES)}] {PHASES[index]}: {detail} (elapsed {spent / 60:.1f} min, about "
            f"{left / 60:.0f} min left)")

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        value = fn()
        phases_s[name] = round(time.monotonic() - t0, 1)
        return value

    if resumed:
        log(f"resuming {run_dir}: phases already finished are kept")
    config_sets = harness_sets(config_sets, log)
    extra = [*set_flags(recipe.rollout_sets()), *config_sets]
    phase(0, f"the tiny model (seed {recipe.seed}) and a {1 - recipe.test_fraction:.0%} train split of the bundled "
             "tasks")
    model = timed("model", lambda: make_model(run_dir, recipe.seed, log))
    train_tasks, test_tasks = write_split(run_dir, recipe)
    log(f"{len(train_tasks)} train / {len(test_tasks)} held-out tasks (split seed {recipe.seed})")
    phase(1, f"gold trajectories, {recipe.give_up} give-up and {recipe.recover} recover copies per train task, "
             "made at once")
    data = timed("sft_data", lambda: sft_data(run_dir, model, recipe, log, config_sets, runner))
    phase(2, f"{recipe.sft_steps} steps x {recipe.sft_batch_size} samples, lr {recipe.sft_lr:g}" +
          _resumed_at(run_dir / "sft"))
    sft_weights = timed("sft", lambda: train(run_dir, "sft", recipe.sft_sets(model, data), log, extra=extra,
                                                    runner=runner))
    train_file, test_file = run_dir / "train.jsonl", run_dir / "test.jsonl"
    phase(3, f"{recipe.eval_samples} episodes per train task at temperature 1, beside GRPO")
    phase(4, f"{recipe.grpo_steps} steps x {recipe.tasks_per_step} tasks x {recipe.n_samples} samples from the SFT "
             f"weights, lr {recipe.grpo_lr:g} {recipe.grpo_schedule}, KL {recipe.kl_coef:g}, " +
             (f"asynchronous (max staleness {recipe.max_staleness})" if recipe.max_staleness else "synchronous") +
          _resumed_at(run_dir / "grpo"))
    sft_argv = eval_argv(recipe, sft_weights, train_file, run_dir / "eval-sft", recipe.eval_samples, extra=config_sets)
    with Beside(sft_argv, "eval eval-sft", run_dir / "eval-sft.log", log) as sft_reading:
        grpo_weights = timed("grpo", lambda: train(run_dir, "grpo", recipe.grpo_sets(sft_weights, train_file), log,
                                                      extra=extra, runner=runner))
    phases_s["sft_reading"] = round(sft_reading.seconds, 1)
    phase(5, f"{recipe.eval_samples} episodes per train task")
    phase(6, f"{recipe.test_samples} episodes per held-out task, beside the GRPO reading")
    test_argv = eval_argv(recipe, grpo_weights, test_file, run_dir / "eval-test", recipe.test_samples,
                          extra=config_sets)
    with Beside(test_argv, "eval eval-test", run_dir / "eval-test.log", log) as test_reading:
        with Plot(run_dir / "grpo", log):  # the curves, beside the readings
            readings_grpo = timed("grpo_reading", lambda: evaluate(
                recipe, grpo_weights, train_file, run_dir / "eval-grpo", recipe.eval_samples, log,
                extra=config_sets, runner=runner))
    phases_s["test_reading"] = round(test_reading.seconds, 1)
    readings: dict[str, dict[str, Any]] = {
        "sft_train": reading(run_dir / "eval-sft", sft_weights), "grpo_train": readings_grpo,
        "test": reading(run_dir / "eval-test", grpo_weights)}
    summary = _summary(run_dir, recipe, readings, phases_s, time.monotonic() - started)
    (run_dir / SUMMARY_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
    for line in summary_table(summary):
        log(line)
    return summary


def _resumed_at(folder: Path) -> str:
    steps = finished_steps(folder)
    return f" (resuming after step {steps})" if steps else ""


class Plot(Beside):
    """`swectl plot` of a run folder beside the caller's work, its output in ``plot.log`` beside the folder. A
    failure is said, not raised: the curves are a convenience, the readings stand without them."""

    def __init__(self, run_dir: Path, say: Say) -> None:
        super().__init__(["plot", str(run_dir)], "plot", run_dir.parent / "plot.log", say)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        except SwectlError as failed:
            self.say(f"plot: {failed}")


def sft_speed(run_dir: Path) -> tuple[float, float]:
    """SFT's median seconds a step and training tokens a second (from ``sft/metrics.jsonl``); zeros when unknown."""
    return train_speed(run_dir / "sft")


def noise_points(a: dict[str, Any], b: dict[str, Any]) -> float:
    """One standard error of reading ``b``'s resolve rate minus reading ``a``'s, in points (two independent binomial
    readings)."""
    var = sum(r["resolve_rate"] * (1 - r["resolve_rate"]) / max(r["episodes"], 1) for r in (a, b))
    return round(100 * math.sqrt(var), 1)


def _summary(run_dir: Path, recipe: Recipe, readings: dict[str, dict[str, Any]], phases_s: dict[str, float],
             seconds: float) -> Summary:
    sft, grpo = readings["sft_train"], readings["grpo_train"]
    step_s, tokens_per_s = sft_speed(run_dir)
    return Summary(seed=recipe.seed, sft_train_resolve_rate=sft["resolve_rate"],
                   grpo_train_resolve_rate=grpo["resolve_rate"], test_resolve_rate=readings["test"]["resolve_rate"],
                   gain_points=round(100 * (grpo["resolve_rate"] - sft["resolve_rate"]), 1),
                   gain_noise_points=noise_points(sft, grpo), minutes=round(seconds / 60, 1), phases_s=phases_s,
                   readings=readings, run_dir=str(run_dir), recipe=msgspec.to_builtins(recipe),
                   sft_step_s=step_s, sft_tokens_per_s=tokens_per_s)


def summary_table(s: Summary) -> list[str]:
    """The lines `swectl up` ends a first run with."""
    r = s.readings

    def row(name: str, key: str) -> str:
        reading = r[key]
        return (f"  {name:<28} {100 * reading['resolve_rate']:5.1f}%  ({reading['resolved']}/{reading['episodes']} "
                f"episodes)")

    minutes = {k: round(v / 60, 1) for k, v in s.phases_s.items()}
    run = Path(s.run_dir)
    return ["", f"first run {run}: {s.minutes} min (seed {s.seed})",
            "  sampled resolve rate (temperature 1)",
            row("train split after SFT", "sft_train"), row("train split after GRPO", "grpo_train"),
            row("held-out split after GRPO", "test"),
            f"  GRPO gain on the train split: {s.gain_points:+.1f} points (one standard error "
            f"{s.gain_noise_points:.1f})",
            "  minutes per phase: " + ", ".join(f"{k} {v}" for k, v in minutes.items()),
            "  (the SFT reading ran beside GRPO, and the held-out reading beside the GRPO reading)",
            *([f"  machine speed: SFT took {s.sft_step_s:.2f} s a step ({s.sft_tokens_per_s / 1000:.1f}k tokens/s); "
               "the minutes scale with it"] if s.sft_step_s else []),
            f"  run folder {run}: summary.json, sft/ and grpo/ (metrics.jsonl, tensorboard/), grpo/plots/, eval-*/",
            f"  look at it: swectl view {run / 'grpo'}   curves: swectl plot {run / 'grpo'}", ""]
