"""`swectl up`: train the policy on a cluster (the RL loop of docs/architecture.md 8.1; swectl/train/controller.py).

With no config file it runs the first run (swectl/train/first_run.py) on the embedded default (one local node, the
CPU engine, a torchrun trainer on gloo): the tiny model, SFT data from a teacher, SFT, GRPO, and readings of the
policy on the train and held-out splits, ending with a table and summary.json. ``--single-run`` runs the embedded
default's [train] section alone instead; a config FILE always runs exactly what it says.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import anyio

from swectl.agent.protocol import agent_templates
from swectl.cli.common import config_args, load_run_config, say
from swectl.config import ClusterConfig, apply_override, decode_config, load_config
from swectl.errors import ConfigError

EPILOG = """\
examples:
  swectl up                              the first run: tiny model, teacher data, SFT, GRPO, readings (its
                                         minutes on 2 cores: README.md); ends with a table and <run>/summary.json
  swectl up --set recipe.seed=3 --set recipe.grpo_steps=10
                                         the first run with another seed and fewer GRPO steps
  swectl up cluster.toml --set train.data.sft_steps=200
                                         your cluster file: SFT on gold trajectories of the train split, then GRPO
  swectl up --resume runs/<run_id>       go on from where the run stopped (a first run: its first unfinished phase)

first run (no FILE): <run>/model, gold/ give-up/ recover/ (SFT data), sft/ and grpo/ (training runs, as below),
  eval-sft/ eval-grpo/ eval-test/ (readings), summary.json, recipe.json, swectl.log. `--set recipe.KEY=VALUE` sets
  its numbers (keys: swectl/train/first_run.py Recipe); other --set keys apply to its SFT and GRPO runs.

outputs of one training run (in <out_dir>/<run_id>/, or the --resume folder):
  metrics.jsonl, tensorboard/   per-step loss, reward, resolve rate, clip fractions, grad norm, timings
  steps.jsonl                   each step's tasks and groups (what was trained on)
  split.json                    the train and held-out task ids (seeded by train.data.split_seed)
  checkpoints/                  every train.save_every steps: model, optimizer, data cursor (resume from it)
  weights/step_N/               the Hugging Face folder the engines were given after step N
  episodes/step_N/, eval/       per-episode artifacts (traj.json, patch.diff, meta.json) and evaluations
  trainer0.log, engine-logs/    the workers' output
Plot the curves with `swectl plot RUN_DIR`; go on after a stop with `swectl up [FILE] --resume RUN_DIR`.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser(
        "up", help="train the policy: rollouts, grading, FSDP2 steps on torchrun workers, weight sync",
        description="Train the policy. With no FILE: the first run (tiny model, teacher data, SFT, GRPO, readings on "
                    "the train and held-out splits). With a FILE: the [train] section (grpo or sft) on its nodes.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_args(up)
    up.add_argument("--resume", metavar="RUN_DIR", default=None,
                    help="go on from the latest checkpoint of this run folder (same config)")
    up.add_argument("--steps", type=int, default=None, metavar="N", help="shorthand for --set train.steps=N")
    up.add_argument("--single-run", action="store_true",
                    help="with no FILE: run the embedded default's [train] section alone (GRPO from the untrained "
                         "tiny model), not the first run")
    up.add_argument("--strict", action="store_true",
                    help="a malformed row of train.data.sft_data stops the run (exit 2) instead of being skipped "
                         "with a warning naming file:line and field (shorthand for --set train.data.sft_strict=true)")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.strict:
        overrides.append("train.data.sft_strict=true")
    from swectl.train.checkpoint import RunState
    from swectl.train.controller import new_run_dir, run_training
    from swectl.train.plan import build_plan

    if _first_run_asked(args):
        return _first_run(args)
    if args.resume:
        run_dir = Path(args.resume)
        if not run_dir.is_dir():
            raise ConfigError(f"--resume {run_dir}: no such run folder")
        config = load_run_config(args.config, overrides) if args.config else _recorded_config(run_dir, overrides)
    else:
        config = load_run_config(args.config, overrides)
        run_dir = new_run_dir(config)
    t = config.train

    async def main() -> RunState:  # the plan (gold trajectories, when it makes them) and the run in one event loop
        plan = await build_plan(config, run_dir, say=say)
        say(f"run {run_dir}: {t.algorithm}, {t.steps} steps, model {plan.model}; "
            + (f"{len(plan.train_tasks)} train / {len(plan.test_tasks)} held-out tasks (split seed "
               f"{t.data.split_seed}), {t.sampling.tasks_per_step} tasks x {t.sampling.n_samples} samples per step"
               if t.algorithm == "grpo"
               else f"{len(plan.sft_samples)} SFT samples"))
        return await run_training(config, plan, run_dir, resume=bool(args.resume), say=say)

    state = anyio.run(main)
    print(json.dumps({"run_dir": str(run_dir), "steps": state.step, "weights": state.weights,
                      "skipped_steps": state.skipped_steps}))
    return 0


def _first_run_asked(args: argparse.Namespace) -> bool:
    if args.resume:
        return (Path(args.resume) / "recipe.json").is_file() and not args.config
    return not args.config and not args.single_run


def _first_run(args: argparse.Namespace) -> int:
    """No FILE: the first run (swectl/train/first_run.py), new or resumed."""
    from swectl.train.controller import new_run_dir
    from swectl.train.first_run import load_recipe, overrides, run_first

    if args.steps is not None:
        raise ConfigError("--steps: the first run has SFT and GRPO steps: --set recipe.sft_steps=N or "
                          "recipe.grpo_steps=N (or give a config FILE, or --single-run)")
    recipe_doc: dict = {}
    config_sets: list[str] = []
    for override in args.overrides:
        if override.strip().startswith("recipe."):
            apply_override(recipe_doc, override)
        else:
            config_sets.append(override)
    if args.strict:
        config_sets.append("train.data.sft_strict=true")
    config = load_config(None, config_sets)  # a wrong key or value stops here, before any phase
    run_dir = Path(args.resume) if args.resume else new_run_dir(config)
    recipe = load_recipe(run_dir, recipe_doc.get("recipe", {}))
    agent_templates(recipe.agent_config)  # a wrong recipe.agent_config stops here too
    # and a recipe whose GRPO run the config refuses (recipe.pass_over with asynchronous GRPO), not after SFT
    grpo_sets = recipe.grpo_sets(run_dir / "sft", run_dir / "train.jsonl")
    load_config(None, [*config_sets, *overrides({**recipe.rollout_sets(), **grpo_sets})])
    phase_sets = [x for o in config_sets if o.split("=", 1)[0].strip() not in ("out_dir", "run_id")
                  for x in ("--set", o)]
    from swectl.cli.main import run_in_process

    summary = run_first(run_dir, recipe, phase_sets, say, run_in_process)  # the phases beside others: subprocesses
    print(json.dumps({"run_dir": str(run_dir), "summary": str(run_dir / "summary.json"),
                      "gain_points": summary.gain_points, "minutes": summary.minutes}))
    return 0


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
