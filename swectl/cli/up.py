"""`swectl up`: train the policy on a cluster (the RL loop of DESIGN section 3; swectl/train/controller.py).

With no config file it runs the embedded default: one local node, the tiny CPU model (made with `swectl model
init` on first use), the CPU engine, a 2-rank torchrun trainer on gloo, GRPO on a seeded train split of the
bundled tasks with the rest held out.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import anyio
import msgspec

from swectl.cli.common import config_args, say
from swectl.config import ClusterConfig, apply_override, decode_config, load_config
from swectl.errors import ConfigError, TaskDataError

EPILOG = """\
outputs (in <out_dir>/<run_id>/, or the --resume folder):
  metrics.jsonl, tensorboard/   per-step loss, reward, resolve rate, clip fractions, grad norm, timings
  steps.jsonl                   each step's tasks and groups (what was trained on)
  split.json                    the train and held-out task ids (seeded by train.split_seed)
  checkpoints/                  every train.save_every steps: model, optimizer, data cursor (resume from it)
  weights/step_N/               the Hugging Face folder the engines were given after step N
  episodes/step_N/, eval/       per-episode artifacts (traj.json, patch.diff, meta.json) and evaluations
  trainer0.log, engine-logs/    the workers' output
Plot the curves with `swectl plot RUN_DIR`; go on after a stop with `swectl up [FILE] --resume RUN_DIR`.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser(
        "up", help="train the policy: rollouts, grading, FSDP2 steps on torchrun workers, weight sync",
        description="Train the policy with the [train] section (grpo or sft) on the config's nodes.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    config_args(up)
    up.add_argument("--resume", metavar="RUN_DIR", default=None,
                    help="go on from the latest checkpoint of this run folder (same config)")
    up.add_argument("--steps", type=int, default=None, metavar="N", help="shorthand for --set train.steps=N")
    up.add_argument("--strict", action="store_true",
                    help="a malformed row of train.sft_data stops the run (exit 2) instead of being skipped with a "
                         "warning naming file:line and field (shorthand for --set train.sft_strict=true)")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.strict:
        overrides.append("train.sft_strict=true")
    from swectl.train.controller import new_run_dir, run_training

    if args.resume:
        run_dir = Path(args.resume)
        if not run_dir.is_dir():
            raise ConfigError(f"--resume {run_dir}: no such run folder")
        config = load_config(args.config, overrides) if args.config else _recorded_config(run_dir, overrides)
    else:
        config = load_config(args.config, overrides)
        run_dir = new_run_dir(config)
    plan = build_plan(config, run_dir)
    t = config.train
    say(f"run {run_dir}: {t.algorithm}, {t.steps} steps, model {plan.model}; "
        + (f"{len(plan.train_tasks)} train / {len(plan.test_tasks)} held-out tasks (split seed {t.split_seed}), "
           f"{t.tasks_per_step} tasks x {t.n_samples} samples per step" if t.algorithm == "grpo"
           else f"{len(plan.sft_samples)} SFT samples"))
    state = anyio.run(lambda: run_training(config, plan, run_dir, resume=bool(args.resume), say=say))
    print(json.dumps({"run_dir": str(run_dir), "steps": state.step, "weights": state.weights,
                      "skipped_steps": state.skipped_steps}))
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


def build_plan(config: ClusterConfig, run_dir: Path):  # -> TrainPlan
    """Resolve the model folder (making the tiny default on first use) and the task splits or SFT samples."""
    from swectl.actors.data_source import split_tasks
    from swectl.train.controller import TrainPlan

    t = config.train
    model = t.model or str(Path(config.out_dir) / "models" / "tiny-qwen3")
    if not t.model and not (Path(model) / "config.json").is_file():
        from swectl.model.tiny import init_model

        say(f"no model given (train.model): making the tiny default at {model} (`swectl model init`)")
        init_model(Path(model), progress=say)
    if not (Path(model) / "config.json").is_file():
        raise ConfigError(f"train.model {model}: not a Hugging Face model folder (no config.json)")
    if t.algorithm == "sft":
        return TrainPlan(model=model, sft_samples=_sft_samples(config, model))
    from swectl.images.project import BUNDLED_TASKS
    from swectl.tasks.sources import load_tasks

    source = t.tasks or str(BUNDLED_TASKS)
    loaded = load_tasks(source)
    if not loaded.tasks:
        raise TaskDataError(f"train.tasks {source}: no usable task in it")
    train, test = split_tasks(loaded.tasks, t.test_fraction, t.split_seed)
    record_split(run_dir / "split.json", SplitRecord(
        tasks=source, test_fraction=t.test_fraction, split_seed=t.split_seed,
        train=[task.instance_id for task in train], held_out=[task.instance_id for task in test]))
    sft = []
    if t.sft_steps:
        sft = _sft_samples(config, model) if t.sft_data else _gold_samples(config, model, train, run_dir / "gold")
    return TrainPlan(model=model, train_tasks=train, test_tasks=test, sft_samples=sft)


class SplitRecord(msgspec.Struct, frozen=True, kw_only=True):
    """split.json: which tasks a grpo run trains on and which it holds out, written when the run starts."""

    tasks: str
    test_fraction: float
    split_seed: int
    train: list[str]
    held_out: list[str]


def record_split(path: Path, split: SplitRecord) -> None:
    """Write ``split`` to ``path``, or, when the run already has one (a resume), refuse a different split: the
    run would go on training on tasks it held out before."""
    if path.is_file():
        try:
            before = msgspec.json.decode(path.read_bytes(), type=SplitRecord)
        except msgspec.DecodeError as e:
            raise ConfigError(f"{path}: not a split record ({e}); move it away to start the split afresh") from e
        if (sorted(before.train), sorted(before.held_out)) != (sorted(split.train), sorted(split.held_out)):
            moved = sorted(set(split.train) - set(before.train))
            raise ConfigError(
                f"{path}: this run started with another train/held-out split ({len(before.train)} train / "
                f"{len(before.held_out)} held out; now {len(split.train)} / {len(split.held_out)}, "
                f"{len(moved)} task(s) would move into training, e.g. {moved[:3]}); train.tasks, "
                f"train.test_fraction or train.split_seed changed since (it was {before.split_seed}, "
                f"now {split.split_seed})")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(split), indent=1) + b"\n")


def _gold_samples(config: ClusterConfig, model: str, tasks: list, out: Path) -> list:
    """SFT data for the first train.sft_steps of a grpo run when train.sft_data is empty: each train-split task's
    gold patch acted out as agent turns in a real sandbox and graded (`swectl data gold`), made once per run."""
    from swectl.data.trajectories import samples_from_runs
    from swectl.eval.agents import load_tokenizer
    from swectl.eval.gold import make_gold

    if not (out / "summary.json").exists():
        if out.exists():  # an interrupted gold run: its partial results would be refused; make them anew
            say(f"{out} holds an unfinished gold run (no summary.json): making it again")
            shutil.rmtree(out)
        out.mkdir(parents=True)
        say(f"train.sft_steps = {config.train.sft_steps} with no train.sft_data: making gold trajectories of the "
            f"{len(tasks)} train-split tasks in {out}")
        tokenizer = load_tokenizer(model, "train.model")
        summary = anyio.run(lambda: make_gold(config, tasks, out, tokenizer, tokenizer_path=model,
                                              concurrency=config.train.concurrency, status=say))
        say(f"{summary.resolved} of {summary.total} gold trajectories resolve and are kept")
    samples = samples_from_runs([out])
    if not samples:
        raise TaskDataError(f"{out}: no gold trajectory resolved; see its summary.json")
    return samples


def _sft_samples(config: ClusterConfig, model: str) -> list:
    from swectl.data.trajectories import samples_from_messages_jsonl, samples_from_runs
    from swectl.eval.agents import load_tokenizer

    if not config.train.sft_data:
        raise ConfigError('train.algorithm = "sft" needs train.sft_data: traj.json run folders (a `swectl eval` or '
                          "`swectl data gold` output) or OpenAI-messages JSONL files")
    samples: list = []
    tokenizer = None
    for item in config.train.sft_data:
        path = Path(item)
        if not path.exists():
            raise ConfigError(f"train.sft_data: {path} does not exist")
        if path.is_file() and path.suffix in (".jsonl", ".json") and path.name != "traj.json":
            tokenizer = tokenizer or load_tokenizer(model, "train.model")
            samples += samples_from_messages_jsonl(path, tokenizer, strict=config.train.sft_strict)
        else:
            # rejection-sampling fine-tuning, unless sft_resolved_only = false (a teacher's every attempt)
            samples += samples_from_runs([path], resolved_only=config.train.sft_resolved_only)
    if not samples:
        raise TaskDataError(f"train.sft_data: no trajectories found in {', '.join(config.train.sft_data)}")
    return samples
