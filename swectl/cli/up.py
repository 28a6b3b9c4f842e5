"""`swectl up`: train the policy on a cluster (the RL loop of docs/architecture.md 8.1; swectl/train/controller.py).

With a config FILE it runs that config's [train] section, exactly what it says. With no FILE it runs a recipe
(swectl/train/recipe.py, run by swectl/cli/phases.py): the bundled first run by default (one local node, the CPU
engine, a torchrun trainer on gloo: the tiny model, SFT data from a teacher, SFT, GRPO, and readings of the policy on
the train and held-out splits, ending with a table and summary.json), or ``--recipe NAME|FILE``. ``--recipe train``
runs the embedded default's [train] section alone.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from swectl.cli.common import config_args, load_run_config, say
from swectl.config import ClusterConfig, apply_override, decode_config, load_config, override_text
from swectl.errors import ConfigError

if TYPE_CHECKING:
    from swectl.train.checkpoint import RunState
    from swectl.train.recipe import Recipe

Say = Callable[[str], None]

EPILOG = """\
examples:
  swectl up                              the first run: tiny model, teacher data, SFT, GRPO, readings (its
                                         minutes on 2 cores: README.md); ends with a table and <run>/summary.json
  swectl up --set recipe.seed=3 --set recipe.grpo_steps=10
                                         the first run with another seed and fewer GRPO steps
  swectl up --recipe train --steps 5     the embedded default's [train] section alone (GRPO from the untrained
                                         tiny model), in <out_dir>/<run_id>
  swectl up --recipe my-recipe.toml      your recipe: phases (model, data, train, eval, plot), each a command
                                         with its own overlay of the config (docs/recipes.md)
  swectl up cluster.toml --set train.data.sft_steps=200
                                         your cluster file: SFT on gold trajectories of the train split, then GRPO
  swectl up --resume runs/<run_id>       go on from where the run stopped (a recipe: its unfinished phases)

first run (no FILE): <run>/model, sft-data/ (gold/ give-up/ recover/), sft/ and grpo/ (training runs, as below),
  eval-sft/ eval-grpo/ eval-test/ (readings), train.jsonl test.jsonl split.json (the split, made once),
  summary.json, recipe.json, phases.json, swectl.log. `--set recipe.NAME=VALUE` sets one of the recipe's [vars]
  (swectl/data/bundled/recipes/first-run.toml); other --set keys apply to every phase that takes a config.

outputs of one training run (in <out_dir>/<run_id>/, or the --resume folder):
  metrics.jsonl, tensorboard/   per-step loss, reward, resolve rate, clip fractions, grad norm, timings
  steps.jsonl                   each step's tasks and groups (what was trained on)
  split.json                    the train and held-out task ids (seeded by train.data.split_seed)
  checkpoints/                  every train.save_every steps: model, optimizer, data cursor (resume from it)
  weights/step_N/               the Hugging Face folder the engines were given after step N
  episodes/step_N/, eval/       per-episode artifacts (traj.json, patch.diff, meta.json) and evaluations
  abandoned/                    folders of groups a restart or resume redid (the abandoned attempt's)
  trainer0.log, engine-logs/    the workers' output
Plot the curves with `swectl plot RUN_DIR`; go on after a stop with `swectl up [FILE] --resume RUN_DIR`.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser(
        "up", help="train the policy: rollouts, grading, FSDP2 steps on torchrun workers, weight sync",
        description="Train the policy. With a FILE: the [train] section (grpo or sft) on its nodes. With no FILE: a "
                    "recipe of phases, by default the first run (tiny model, teacher data, SFT, GRPO, readings on the "
                    "train and held-out splits).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_args(up)
    up.add_argument("--recipe", metavar="NAME|FILE", default=None,
                    help="with no FILE: the recipe to run, a bundled one's name (first-run, the default; train: the "
                         "embedded default's [train] section alone) or a recipe TOML file")
    up.add_argument("--resume", metavar="RUN_DIR", default=None,
                    help="go on from the latest checkpoint of this run folder (same config); a recipe's run folder: "
                         "from its unfinished phases")
    up.add_argument("--steps", type=int, default=None, metavar="N",
                    help="shorthand for --set train.steps=N (a recipe: only one with a single train phase)")
    up.add_argument("--strict", action="store_true",
                    help="a malformed row of train.data.sft_data stops the run (exit 2) instead of being skipped "
                         "with a warning naming file:line and field (shorthand for --set train.data.sft_strict=true)")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.strict:
        overrides.append("train.data.sft_strict=true")
    from swectl.train.controller import new_run_dir

    if args.config and args.recipe:
        raise ConfigError("--recipe runs a recipe, FILE a config: give one (a recipe's phases may start from a config "
                          "FILE: its `base`)")
    if _recipe_asked(args):
        return _run_recipe(args, overrides)
    if args.resume:
        run_dir = Path(args.resume)
        if not run_dir.is_dir():
            raise ConfigError(f"--resume {run_dir}: no such run folder")
        config = load_run_config(args.config, overrides) if args.config else _recorded_config(run_dir, overrides)
    else:
        config = load_run_config(args.config, overrides)
        run_dir = new_run_dir(config)
    anyio.run(lambda: train(config, run_dir, resume=bool(args.resume), say=say))
    return 0


async def train(config: ClusterConfig, run_dir: Path, *, resume: bool, say: Say) -> RunState:
    """One training run of ``config`` in ``run_dir`` (its plan, then the run, in the running event loop): the driver
    `swectl up FILE` and a recipe's train phases call. Its final state (a RunState), also printed as one JSON line."""
    from swectl import logs
    from swectl.train.controller import run_training
    from swectl.train.plan import build_plan

    t = config.train
    plan = await build_plan(config, run_dir, say=say)  # gold trajectories, when it makes them
    say(f"run {run_dir}: {t.algorithm}, {t.steps} steps, model {plan.model}; "
        + (f"{len(plan.train_tasks)} train / {len(plan.test_tasks)} held-out tasks (split seed "
           f"{t.data.split_seed}), {t.sampling.tasks_per_step} tasks x {t.sampling.n_samples} samples per step"
           if t.algorithm == "grpo"
           else f"{len(plan.sft_samples)} SFT samples"))
    state = await run_training(config, plan, run_dir, resume=resume, say=say)
    print(json.dumps({"run_dir": str(run_dir), "steps": state.step, "weights": state.weights,
                      "skipped_steps": state.skipped_steps}), file=logs.out())
    return state


def _recipe_asked(args: argparse.Namespace) -> bool:
    if args.resume:
        return (Path(args.resume) / "recipe.json").is_file() and not args.config
    return not args.config


def _run_recipe(args: argparse.Namespace, overrides: list[str]) -> int:
    """No FILE: a recipe (the first run unless --recipe names another), new or resumed."""
    from swectl.cli.phases import run_recipe
    from swectl.train import recipe as recipes
    from swectl.train.controller import new_run_dir

    recipe_doc: dict = {}
    config_sets: list[str] = []
    for override in overrides:
        if override.strip().startswith("recipe."):
            apply_override(recipe_doc, override)
        else:
            config_sets.append(override)
    wanted = recipe_doc.get("recipe", {})
    saved = recipes.saved_recipe(Path(args.resume), wanted) if args.resume else None
    recipe = saved or recipes.load(args.recipe or recipes.DEFAULT_RECIPE, wanted)
    if args.steps is not None and len(recipe.trains) != 1:
        raise ConfigError(f"--steps: recipe {recipe.name} has {len(recipe.trains)} train phases; set the steps of "
                          f"each by its vars (--set recipe.NAME=N; {recipe.source})")
    config_sets = _harness_sets(recipe, config_sets, say)
    config = load_config(recipe.file.base or None, [*(saved.sets if saved else []), *config_sets])  # a wrong
    # key or value stops here
    run_dir = Path(args.resume) if args.resume else new_run_dir(config)
    phase_sets = [*(saved.sets if saved else []),
                  *(o for o in config_sets if o.split("=", 1)[0].strip() not in ("out_dir", "run_id"))]
    recipe = msgspec.structs.replace(recipe, sets=phase_sets)  # recorded: a resume applies them again
    summary = anyio.run(lambda: run_recipe(recipe, run_dir, phase_sets, say))
    if recipe.file.report is not None:
        print(json.dumps({"run_dir": str(run_dir), "summary": str(run_dir / recipes.SUMMARY_FILE),
                          "gain_points": summary.gain_points, "minutes": summary.minutes}))
    return 0


def _harness_sets(recipe: Recipe, config_sets: list[str], say: Say) -> list[str]:
    """The user's ``KEY=VALUE`` overrides, with the recipe's ``harness_config`` added when they name an external
    harness (``agent.harness``) and no config for it."""
    keys = {flag.split("=", 1)[0].strip() for flag in config_sets}
    if not recipe.file.harness_config or "agent.harness" not in keys or "agent.harness_config" in keys:
        return list(config_sets)
    say(f"agent.harness is set: the harness runs with the recipe's harness config "
        f"(agent.harness_config = {recipe.file.harness_config!r})")
    return [*config_sets, override_text("agent.harness_config", recipe.file.harness_config)]


def _recorded_config(run_dir: Path, overrides: list[str]) -> ClusterConfig:
    """The config a run was started with (its config.json), with ``--set`` overrides applied."""
    path = run_dir / "config.json"
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume {run_dir}: cannot read its {path.name} ({exc}); give the config FILE") from exc
    for override in overrides:
        apply_override(document, override)
    return decode_config(document, str(path))
