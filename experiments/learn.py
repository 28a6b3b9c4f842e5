"""`just learn`: does the policy learn, on this CPU machine? The whole demo through swectl's own commands.

1. the tiny model (`swectl model init`), a seeded train/test split of the bundled tasks (the split `swectl up`
   makes with train.data.test_fraction 0.5 and train.data.split_seed = --seed);
2. gold trajectories of the train split (`swectl data gold`: each gold patch acted out as agent turns) and, with
   ``--give-up K`` (default 1), K copies of a wrong teacher's trajectory per task (`swectl data gold --script
   give-up`: the same first look at the code, then a submission with no change) and, with ``--recover K``
   (default 1), K copies of a teacher that slips and recovers (`swectl data gold --script recover`: a cut-off,
   malformed copy of the first look and of the edit before each; SFT masks the malformed replies);
3. SFT on them all (`swectl up` with train.algorithm = "sft", train.data.sft_resolved_only = false) to a checkpoint
   that edits on some tries and gives up on others: it imitates a teacher that is right 1 time in K+1, and only
   the reward says which attempts are right;
4. GRPO from that checkpoint (`swectl up`; 30 steps with a KL anchor to the SFT weights, ``--kl-coef`` 0.5), and
   control runs, so any gain of the real run is shown to come from
   the reward: the same with every advantage zeroed (experiment.zero_advantages: no update at all; the default
   control) and, with ``--controls zero,shuffle``, the same with each group's rewards shuffled
   (experiment.shuffle_rewards: updates as large as the real run's, blind to which episode resolved its task);
5. sampled resolve rates (temperature 1, ``--samples`` episodes per task, `swectl eval --seed`) on the train split
   before training, after SFT, after GRPO and after each control run, and on the held-out split after GRPO.

Every sample is seeded: the GRPO rollouts by train.seed (each request's sampling seed comes from the seed, the step,
the task, the sample and the turn), the evaluations by ``--eval-seed``. So a rerun with the same seed draws the same
random numbers and reads the same rates, up to float rounding in the engine's batches.
   The zero-advantage control makes no update, so its final weights are the SFT weights: when their sha256 agree,
   the SFT and control evaluations are pooled into one estimate of the SFT policy (``train_after_sft_pooled_pct``)
   and GRPO's gain is also reported against it (``grpo_gain_vs_pooled_sft_points``, the less noisy reading).

Writes ``benchmarks/results/learn.json`` (rates, per-step GRPO curves of both runs, timings, the seed) and keeps
every run folder under ``--work`` (default runs/learn-seed<seed>).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import msgspec

from swectl.train import first_run
from swectl.train.first_run import Recipe, set_flags

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "learn.json"
RECIPE = Recipe()  # the product's first-run recipe: every flag below that shares a name defaults to it
# The demo's episodes (prm.py runs its episodes the same way)
DEMO_ROLLOUT = Recipe().rollout_sets()


def say(message: str) -> None:
    print(f"learn: {message}", file=sys.stderr, flush=True)


def recipe_of(args: argparse.Namespace) -> Recipe:
    """The recipe these flags give: each Recipe field from the flag of its name."""
    return msgspec.convert({k: getattr(args, k) for k in Recipe.__struct_fields__ if hasattr(args, k)}, Recipe)


def weights_digest(weights: Path) -> str:
    """sha256 over a weights folder's safetensors files (names and bytes): equal digests, equal policies."""
    digest = hashlib.sha256()
    for path in sorted(weights.glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def pooled_sft(rates: dict[str, dict]) -> dict | None:
    """The SFT policy's rate from every evaluation of it: the SFT evaluation and, when the zero-advantage control's
    final weights are the SFT weights byte for byte (it made no update), the control's evaluation too. Two
    evaluations of one policy are one sample twice as large; None when there is nothing to pool."""
    sft, control = rates.get("train_after_sft"), rates.get("train_after_control")
    if sft is None or control is None:
        return None
    if weights_digest(Path(sft["model"])) != weights_digest(Path(control["model"])):
        return None
    resolved, episodes = sft["resolved"] + control["resolved"], sft["episodes"] + control["episodes"]
    return {"resolve_rate": round(resolved / episodes, 4), "resolved": resolved, "episodes": episodes,
            "evaluations": [sft["folder"], control["folder"]]}


def check_trained_on(run_dir: Path, train_tasks: list) -> None:
    """Stop unless every task the run trained on (its steps.jsonl) is one of the bench's train split: the
    evaluations read the train split, and a run that trained on held-out tasks would make the test reading moot
    (a ``--grpo-set train.data.split_seed=...`` or ``train.data.tasks=...`` could do that)."""
    allowed = {t.instance_id for t in train_tasks}
    trained = {task for line in (run_dir / "steps.jsonl").read_text().splitlines() if line.strip()
               for task in json.loads(line).get("tasks", [])}
    if trained - allowed:
        raise SystemExit(f"learn: {run_dir.name} trained on {len(trained - allowed)} task(s) outside the train split "
                         f"(e.g. {sorted(trained - allowed)[:3]}): its readings would not be a learning check")


def curve(run_dir: Path, after: int = 0) -> list[dict]:
    keep = ("step", "reward_mean", "resolve_rate", "loss", "groups", "groups_dropped_uninformative", "entropy",
            "adv/nonzero_frac")
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if ("loss" in record or "reward_mean" in record) and record.get("step", 0) > after:
            out.append({k: record[k] for k in keep if k in record})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-seed", type=int, default=None, metavar="N",
                        help="sampling seed of the evaluations (default: --seed); the zero-advantage control's "
                             "reading uses N+1, so pooled with the SFT's it adds new episodes")
    parser.add_argument("--work", type=Path, default=None, help="folder for every run (default runs/learn-seed<seed>)")
    parser.add_argument("--samples", type=int, default=8,
                        help="episodes per task in the train-split evaluations after SFT, GRPO and the controls")
    parser.add_argument("--before-samples", type=int, default=2,
                        help="episodes per task in the evaluation of the untrained model")
    parser.add_argument("--test-samples", type=int, default=4,
                        help="episodes per task in the held-out evaluation after GRPO")
    parser.add_argument("--sft-steps", type=int, default=None,
                        help=f"SFT steps (batch 8); default {RECIPE.sft_steps} (the first run's), and 4x that with "
                             "--manage-context: its SFT data has one sample per agent step (about four per "
                             "trajectory), so each reply is still seen as often")
    parser.add_argument("--sft-lr", type=float, default=RECIPE.sft_lr)
    parser.add_argument("--sft-schedule", choices=("constant", "cosine"), default=RECIPE.sft_schedule,
                        help="SFT learning-rate schedule (cosine: down to a tenth of --sft-lr)")
    parser.add_argument("--give-up", type=int, default=RECIPE.give_up, metavar="K",
                        help="SFT data from a noisy teacher: besides each task's gold trajectory, K copies of a "
                             "trajectory that looks at the same code and submits no change (`swectl data gold "
                             "--script give-up`), so the SFT model edits on some tries and gives up on others")
    parser.add_argument("--recover", type=int, default=RECIPE.recover, metavar="K",
                        help="SFT data: K copies per task of a teacher that slips and recovers (`swectl data gold "
                             "--script recover`: the gold replies, each of the first two after a cut-off copy the "
                             "agent loop rejects as malformed; SFT masks the malformed ones), so the model answers a "
                             "format error with the right reply instead of more malformed ones")
    parser.add_argument("--grpo-steps", type=int, default=RECIPE.grpo_steps)
    parser.add_argument("--kl-coef", type=float, default=RECIPE.kl_coef,
                        help="GRPO: weight of the KL penalty to the SFT weights (train.loss.kl_coef, low_var_kl); 0 = "
                             "none. "
                             "The anchor keeps a seed near the SFT policy's format while the reward moves it; with "
                             "the cosine schedule five seeds at 30 steps read +12.2 to +26.0 points over SFT "
                             "(benchmarks/results/learn.json)")
    parser.add_argument("--grpo-lr", type=float, default=RECIPE.grpo_lr,
                        help="GRPO learning rate (--grpo-start weights)")
    parser.add_argument("--grpo-schedule", choices=("constant", "cosine"), default=RECIPE.grpo_schedule,
                        help="GRPO learning-rate schedule (--grpo-start weights; train.optim.schedule): cosine "
                             "(default) "
                             "decays --grpo-lr to a tenth by the last step; with a constant rate, weak seeds lost by "
                             "step 30 what they had at step 10 (benchmarks/results/learn.json)")
    parser.add_argument("--max-staleness", type=int, default=RECIPE.max_staleness,
                        help="GRPO: steps a group's weights may lag the trainer's (train.sampling.max_staleness); "
                             "0 = synchronous, 1 (default) = the next step's rollouts run while the trainer trains")
    parser.add_argument("--grpo-trainer-threads", type=int, default=RECIPE.grpo_trainer_threads,
                        help="GRPO trainer threads (0, the default: 1 when asynchronous, whose rollouts run "
                             "beside the training, else the machine's cores)")
    parser.add_argument("--grpo-start", choices=("checkpoint", "weights"), default="weights",
                        help="weights (default): a new run from the SFT weights with a fresh optimizer; checkpoint: "
                             "GRPO goes on from the SFT run's last checkpoint (its optimizer state and learning rate)")
    parser.add_argument("--tasks-per-step", type=int, default=RECIPE.tasks_per_step)
    parser.add_argument("--n-samples", type=int, default=RECIPE.n_samples, help="GRPO group size")
    parser.add_argument("--step-limit", type=int, default=RECIPE.step_limit)
    parser.add_argument("--max-tokens", type=int, default=RECIPE.max_tokens)
    parser.add_argument("--context", type=int, default=RECIPE.context,
                        help="context budget in tokens of every episode, training and evaluation (rollout.context)")
    parser.add_argument("--manage-context", action="store_true",
                        help="head+tail context management when an episode outgrows --context, in training and "
                             "in every evaluation (rollout.manage_context); pair with per-step samples: "
                             "--grpo-set train.sampling.sample_mode='\"step\"'. The SFT data is made under it too: "
                             "each "
                             "gold step records the prompt the engine would see, so SFT trains on those")
    parser.add_argument("--max-format-errors", type=int, default=RECIPE.max_format_errors,
                        help="malformed replies in a row that end an episode (rollout.max_format_errors)")
    parser.add_argument("--concurrency", type=int, default=RECIPE.concurrency)
    parser.add_argument("--agent-config", default=RECIPE.agent_config, metavar="NAME|PATH",
                        help=f"the agent's prompts (rollout.agent_config; default {RECIPE.agent_config!r}, \"\": the "
                             "built-in prompt)")
    parser.add_argument("--mask-truncated", action=argparse.BooleanOptionalAction, default=RECIPE.mask_truncated,
                        help="GRPO: truncated episodes (step limit, malformed replies) carry no gradient")
    parser.add_argument("--mask-truncated-endings", choices=("all", "overlong"),
                        default=RECIPE.mask_truncated_endings,
                        help="with --mask-truncated, which endings are masked: all (the step limit, time, context and "
                             "the malformed-reply limit) or overlong (not the malformed-reply limit: those episodes "
                             "train their well-formed turns with their advantage)")
    parser.add_argument("--mask-format-errors", action=argparse.BooleanOptionalAction,
                        default=RECIPE.mask_format_errors,
                        help="GRPO: malformed replies carry no gradient (train.loss.mask_format_errors); the turns "
                             "around "
                             "them train as usual")
    parser.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE",
                        help="more `--set` overrides for the GRPO and control runs (repeatable)")
    parser.add_argument("--tag", default="", help="suffix of the GRPO and control run folders (to compare settings)")
    parser.add_argument("--controls", default="zero",
                        help="control runs, comma-separated: zero (advantages zeroed), shuffle (rewards shuffled)")
    parser.add_argument("--no-control", action="store_true", help="skip the control runs")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.eval_seed is None:
        args.eval_seed = args.seed
    if args.sft_steps is None:
        args.sft_steps = RECIPE.sft_steps * (4 if args.manage_context else 1)
    work = (args.work or Path("runs") / f"learn-seed{args.seed}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    timings: dict[str, float] = {}
    recipe = recipe_of(args)

    def timed(key: str, fn):
        t0 = time.monotonic()
        value = fn()
        timings[key] = time.monotonic() - t0
        return value

    model = timed("model_init_s", lambda: first_run.make_model(work, args.seed, say))
    train_tasks, test_tasks = first_run.write_split(work, recipe)
    sft_data = timed("sft_data_s", lambda: first_run.sft_data(work, model, recipe, say))

    def evaluate(weights: Path, split: str, out: str, samples: int, seed_offset: int = 0) -> dict:
        return first_run.evaluate(recipe, weights, work / f"{split}.jsonl", work / out, samples, say, seed_offset)

    rates: dict[str, dict] = {}
    rates["train_before"] = timed("eval_before_s", lambda: evaluate(model, "train", "eval-before",
                                                                    args.before_samples))
    rollout = set_flags(recipe.rollout_sets())
    sft_weights = timed("sft_s", lambda: first_run.train(work, "sft", recipe.sft_sets(model, sft_data), say,
                                                         extra=rollout))
    rates["train_after_sft"] = evaluate(sft_weights, "train", "eval-sft", args.samples)

    continue_sft = args.grpo_start == "checkpoint"
    grpo_sets = recipe.grpo_sets(sft_weights)
    if continue_sft:  # steps 1..sft_steps were the SFT run's; the optimizer's learning rate is the SFT's
        for key in ("train.model", "train.optim.lr", "train.optim.schedule"):
            del grpo_sets[key]
        grpo_sets.update({"train.data.sft_steps": args.sft_steps, "train.steps": args.sft_steps + args.grpo_steps})
    for item in args.grpo_set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--grpo-set wants KEY=VALUE, got {item!r}")
        grpo_sets[key] = value
    runs = {"grpo": grpo_sets}
    controls = {"zero": ("control", "experiment.zero_advantages"),
                "shuffle": ("control_shuffle", "experiment.shuffle_rewards")}
    for control in filter(None, ([] if args.no_control else args.controls.split(","))):
        if control not in controls:
            parser.error(f"--controls: unknown control {control!r} (choose from {', '.join(controls)})")
        name, key = controls[control]
        runs[name] = {**grpo_sets, key: "true"}
    suffix = f"-{args.tag}" if args.tag else ""
    curves = {}
    for name, sets in runs.items():
        weights = timed(f"{name}_s", lambda name=name, sets=sets: first_run.train(
            work, name + suffix, sets, say, extra=rollout, continue_from=work / "sft" if continue_sft else None))
        check_trained_on(work / (name + suffix), train_tasks)
        curves[name] = curve(work / (name + suffix), after=args.sft_steps if continue_sft else 0)
        rates[f"train_after_{name}"] = evaluate(weights, "train", f"eval-{name}{suffix}", args.samples,
                                                seed_offset=0 if name == "grpo" else 1)
        if name == "grpo":
            rates["test_after_grpo"] = evaluate(weights, "test", f"eval-grpo{suffix}-test", args.test_samples)

    def pct(key: str) -> float | None:  # None (JSON null) for a phase not run (--no-control)
        return round(100 * rates[key]["resolve_rate"], 1) if key in rates else None

    def gain(key: str) -> float | None:
        after, before = pct(key), pct("train_after_sft")
        return round(after - before, 1) if after is not None and before is not None else None

    pooled = pooled_sft(rates)
    result = {
        "seed": args.seed, "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "train_tasks": len(train_tasks), "test_tasks": len(test_tasks),
        "resolve_rate_pct": {k: pct(k) for k in rates},
        "grpo_gain_points": gain("train_after_grpo"), "control_gain_points": gain("train_after_control"),
        "shuffle_control_gain_points": gain("train_after_control_shuffle"),
        "train_after_sft_pooled_pct": None if pooled is None else round(100 * pooled["resolve_rate"], 1),
        "grpo_gain_vs_pooled_sft_points": (None if pooled is None or pct("train_after_grpo") is None
                                           else round(pct("train_after_grpo") - 100 * pooled["resolve_rate"], 1)),
        "sft_pooled": pooled,
        "rates": rates, "curves": curves, "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "total_minutes": round((time.monotonic() - started) / 60, 1), "work": str(work),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.results.read_text()) if args.results.exists() else {}
    runs_by_key = previous.get("runs", {}) if isinstance(previous, dict) else {}
    runs_by_key[f"seed{args.seed}:{work.name}{suffix}"] = result
    kept = previous if isinstance(previous, dict) else {}  # other keys (a file's notes) stay as they are
    args.results.write_text(json.dumps({**kept, "runs": runs_by_key, "latest": result}, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("seed", "resolve_rate_pct", "grpo_gain_points", "control_gain_points",
                                                "shuffle_control_gain_points", "train_after_sft_pooled_pct",
                                                "grpo_gain_vs_pooled_sft_points", "total_minutes")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
