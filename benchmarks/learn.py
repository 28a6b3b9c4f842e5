"""`just learn`: does the policy learn, on this CPU machine? The whole demo through swectl's own commands.

1. the tiny model (`swectl model init`), a seeded train/test split of the bundled tasks (the split `swectl up`
   makes with train.data.test_fraction 0.5 and train.data.split_seed = --seed);
2. gold trajectories of the train split (`swectl data gold`: each gold patch acted out as agent turns) and, with
   ``--give-up K`` (default 1), K copies of a wrong teacher's trajectory per task (`swectl data gold --script
   give-up`: the same first look at the code, then a submission with no change) and, with ``--recover K``
   (default 1), K copies of a teacher that slips and recovers (`swectl data gold --script recover`: a cut-off,
   malformed copy of the first look and of the edit before each; SFT masks the malformed replies);
3. SFT on them all (`swectl up` with train.algorithm = "sft", experiment.sft_resolved_only = false) to a checkpoint
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
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from swectl.actors.data_source import split_tasks
from swectl.config import TRUNCATED_ENDINGS
from swectl.images.project import BUNDLED_TASKS
from swectl.tasks.sources import load_tasks

RESULTS = Path(__file__).resolve().parent / "results" / "learn.json"
OVERLONG_ENDINGS = [e for e in TRUNCATED_ENDINGS if e != "FormatError"]  # the TRUNCATED endings but FormatError
SWECTL = [sys.executable, "-m", "swectl.cli.main"]


def say(message: str) -> None:
    print(f"learn: {message}", file=sys.stderr, flush=True)


def run(argv: list[str], what: str) -> float:
    """Run one swectl command; its output goes to the terminal. Returns the seconds it took."""
    say(f"{what}: swectl {' '.join(argv)}")
    t0 = time.monotonic()
    done = subprocess.run([*SWECTL, *argv])
    if done.returncode != 0:
        raise SystemExit(f"learn: {what} failed (exit {done.returncode})")
    return time.monotonic() - t0


# The demo's episodes: the flag defaults below (prm.py runs its episodes the same way).
DEMO_ROLLOUT = {"rollout.step_limit": 6, "rollout.max_tokens": 192, "rollout.max_format_errors": 3,
                "env_pool.warm": 0}


def set_flags(sets: dict[str, object]) -> list[str]:
    """``--set KEY=VALUE`` arguments of `swectl up`, one pair per entry."""
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def rollout_sets(args: argparse.Namespace) -> list[str]:
    return set_flags({**DEMO_ROLLOUT, "rollout.step_limit": args.step_limit, "rollout.max_tokens": args.max_tokens,
                      "rollout.max_format_errors": args.max_format_errors, "rollout.context": args.context,
                      "rollout.manage_context": str(args.manage_context).lower()})


def evaluate(args: argparse.Namespace, model: Path, tasks: Path, out: Path, samples: int | None = None,
             seed_offset: int = 0) -> dict:
    """`swectl eval` of ``model`` on ``tasks`` (``samples`` episodes per task, default ``--samples``) into ``out``,
    once: a folder with a summary is read back. Sampling is seeded with ``--eval-seed`` + ``seed_offset``: every
    reading of one seed draws the same random numbers (a rerun of the demo reads the same rates), and two
    readings of one policy that are pooled take different offsets, so they are independent samples."""
    if not (out / "summary.json").exists():
        run(["eval", "--model", str(model), "--tasks", str(tasks), "--samples", str(samples or args.samples),
             "--seed", str(args.eval_seed + seed_offset), "--temperature",
             "1.0", "--step-limit", str(args.step_limit), "--max-tokens", str(args.max_tokens), "--concurrency",
             str(args.concurrency), "--out", str(out), "--fresh", "--set", "env_pool.warm=0", "--set",
             f"rollout.max_format_errors={args.max_format_errors}", "--context", str(args.context),
             *(["--manage-context"] if args.manage_context else [])], f"eval {out.name}")
    summary = json.loads((out / "summary.json").read_text())
    return {"resolve_rate": summary["resolve_rate"], "resolved": summary["resolved"], "episodes": summary["finished"],
            "aborted": summary["infra_errors"], "folder": str(out), "model": str(model),
            "seed": summary["settings"]["rollout"].get("seed")}


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


def train(args: argparse.Namespace, out_dir: Path, run_id: str, sets: dict[str, object],
          continue_from: Path | None = None) -> Path:
    """One `swectl up` run in ``out_dir/run_id``: a new run with ``sets``, or (``continue_from``, an SFT run folder)
    a copy of that run resumed from its last checkpoint with ``sets`` as overrides, so the GRPO steps go on with
    the SFT's optimizer state (Adam's moments) and learning rate instead of a fresh optimizer."""
    folder = out_dir / run_id
    overrides = set_flags(sets)
    if continue_from is not None:
        if not folder.exists():
            shutil.copytree(continue_from, folder)
        argv = ["up", "--resume", str(folder), *rollout_sets(args), *overrides]
    elif (folder / "checkpoints" / "latest").exists():  # go on (or stop) at the steps asked for now
        argv = ["up", "--resume", str(folder), "--steps", str(sets["train.steps"])]
    else:
        argv = ["up", "--set", f"out_dir={str(out_dir)!r}", "--set", f"run_id={run_id!r}", *rollout_sets(args),
                *overrides]
    run(argv, f"train {run_id}")
    return final_weights(folder)


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


def final_weights(run_dir: Path) -> Path:
    """The weights folder of a `swectl up` run's latest checkpoint."""
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return Path(json.loads((run_dir / "checkpoints" / latest / "controller.json").read_text())["weights"])


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
                        help="SFT steps (batch 8); default 400, and 1600 with --manage-context: its SFT data has one "
                             "sample per agent step (about four per trajectory), so each reply is still seen as often")
    parser.add_argument("--sft-lr", type=float, default=2e-3)
    parser.add_argument("--sft-schedule", choices=("constant", "cosine"), default="constant",
                        help="SFT learning-rate schedule (cosine: down to a tenth of --sft-lr)")
    parser.add_argument("--give-up", type=int, default=1, metavar="K",
                        help="SFT data from a noisy teacher: besides each task's gold trajectory, K copies of a "
                             "trajectory that looks at the same code and submits no change (`swectl data gold "
                             "--script give-up`), so the SFT model edits on some tries and gives up on others")
    parser.add_argument("--recover", type=int, default=1, metavar="K",
                        help="SFT data: K copies per task of a teacher that slips and recovers (`swectl data gold "
                             "--script recover`: the gold replies, each of the first two after a cut-off copy the "
                             "agent loop rejects as malformed; SFT masks the malformed ones), so the model answers a "
                             "format error with the right reply instead of more malformed ones")
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--kl-coef", type=float, default=0.5,
                        help="GRPO: weight of the KL penalty to the SFT weights (train.loss.kl_coef, low_var_kl); 0 = "
                             "none. "
                             "The anchor keeps a seed near the SFT policy's format while the reward moves it; with "
                             "the cosine schedule five seeds at 30 steps read +12.2 to +26.0 points over SFT "
                             "(benchmarks/results/learn.json)")
    parser.add_argument("--grpo-lr", type=float, default=2e-4, help="GRPO learning rate (--grpo-start weights)")
    parser.add_argument("--grpo-schedule", choices=("constant", "cosine"), default="cosine",
                        help="GRPO learning-rate schedule (--grpo-start weights; train.optim.schedule): cosine "
                             "(default) "
                             "decays --grpo-lr to a tenth by the last step; with a constant rate, weak seeds lost by "
                             "step 30 what they had at step 10 (benchmarks/results/learn.json)")
    parser.add_argument("--grpo-start", choices=("checkpoint", "weights"), default="weights",
                        help="weights (default): a new run from the SFT weights with a fresh optimizer; checkpoint: "
                             "GRPO goes on from the SFT run's last checkpoint (its optimizer state and learning rate)")
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--n-samples", type=int, default=4, help="GRPO group size")
    parser.add_argument("--step-limit", type=int, default=DEMO_ROLLOUT["rollout.step_limit"])
    parser.add_argument("--max-tokens", type=int, default=DEMO_ROLLOUT["rollout.max_tokens"])
    parser.add_argument("--context", type=int, default=8192,
                        help="context budget in tokens of every episode, training and evaluation (rollout.context)")
    parser.add_argument("--manage-context", action="store_true",
                        help="head+tail context management when an episode outgrows --context, in training and "
                             "in every evaluation (rollout.manage_context); pair with per-step samples: "
                             "--grpo-set train.sampling.sample_mode='\"step\"'. The SFT data is made under it too: "
                             "each "
                             "gold step records the prompt the engine would see, so SFT trains on those")
    parser.add_argument("--max-format-errors", type=int,
                        default=DEMO_ROLLOUT["rollout.max_format_errors"],
                        help="malformed replies in a row that end an episode (rollout.max_format_errors)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--mask-truncated", action=argparse.BooleanOptionalAction, default=True,
                        help="GRPO: truncated episodes (step limit, malformed replies) carry no gradient")
    parser.add_argument("--mask-truncated-endings", choices=("all", "overlong"), default="all",
                        help="with --mask-truncated, which endings are masked: all (the step limit, time, context and "
                             "the malformed-reply limit) or overlong (not the malformed-reply limit: those episodes "
                             "train their well-formed turns with their advantage)")
    parser.add_argument("--mask-format-errors", action=argparse.BooleanOptionalAction, default=True,
                        help="GRPO: malformed replies carry no gradient (experiment.mask_format_errors); the turns "
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
        args.sft_steps = 1600 if args.manage_context else 400
    work = (args.work or Path("runs") / f"learn-seed{args.seed}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    timings: dict[str, float] = {}

    model = work / "model"
    if not (model / "config.json").exists():
        timings["model_init_s"] = run(["model", "init", "--out", str(model), "--seed", str(args.seed)], "model")
    train_tasks, test_tasks = split_tasks(load_tasks(BUNDLED_TASKS).tasks, 0.5, args.seed)
    for name, tasks in (("train", train_tasks), ("test", test_tasks)):
        (work / f"{name}.jsonl").write_bytes(b"".join(msgspec.json.encode(t) + b"\n" for t in tasks))

    def scripted(script: str) -> Path:
        """`swectl data gold --script SCRIPT` on the train split into work/SCRIPT, once."""
        out = work / script
        if not (out / "summary.json").exists():
            timings[f"{script.replace('-', '_')}_s"] = run(
                ["data", "gold", "--script", script, "--tasks", str(work / "train.jsonl"), "--model", str(model),
                 "--out", str(out), "--concurrency", "4", *rollout_sets(args)], script)
        return out

    gold = scripted("gold")
    sft_data = ([str(gold)] + ([str(scripted("give-up"))] * args.give_up if args.give_up else [])
                + ([str(scripted("recover"))] * args.recover if args.recover else []))

    rates: dict[str, dict] = {}
    t0 = time.monotonic()
    rates["train_before"] = evaluate(args, model, work / "train.jsonl", work / "eval-before", args.before_samples)
    timings["eval_before_s"] = time.monotonic() - t0

    t0 = time.monotonic()
    sft_weights = train(args, work, "sft", {
        "train.model": repr(str(model)), "train.algorithm": '"sft"', "train.data.sft_data": json.dumps(sft_data),
        "experiment.sft_resolved_only": str(not args.give_up).lower(),
        "train.steps": args.sft_steps,
        "train.data.sft_batch_size": 8, "train.optim.lr": args.sft_lr, "train.optim.warmup_steps": 3,
        "train.optim.schedule": f'"{args.sft_schedule}"', "train.seed": args.seed,
        "train.save_every": args.sft_steps})
    timings["sft_s"] = time.monotonic() - t0
    rates["train_after_sft"] = evaluate(args, sft_weights, work / "train.jsonl", work / "eval-sft")

    continue_sft = args.grpo_start == "checkpoint"
    grpo_sets: dict[str, object] = {
        "train.algorithm": '"grpo"', "train.sampling.tasks_per_step": args.tasks_per_step,
        "train.sampling.n_samples": args.n_samples, "train.seed": args.seed, "train.data.split_seed": args.seed,
        "train.data.test_fraction": 0.5, "train.save_every": 5,
        "train.concurrency": args.concurrency, "train.sampling.max_sampling_rounds": 2,
        "experiment.mask_truncated": str(args.mask_truncated).lower(),
        "experiment.mask_truncated_endings": json.dumps(OVERLONG_ENDINGS if args.mask_truncated_endings == "overlong"
                                                   else [*OVERLONG_ENDINGS, "FormatError"]),
        "experiment.mask_format_errors": str(args.mask_format_errors).lower(), "train.loss.kl_coef": args.kl_coef}
    if continue_sft:  # steps 1..sft_steps were the SFT run's; the optimizer's learning rate is the SFT's
        grpo_sets.update({"train.data.sft_steps": args.sft_steps, "train.steps": args.sft_steps + args.grpo_steps})
    else:
        grpo_sets.update({"train.model": repr(str(sft_weights)), "train.steps": args.grpo_steps,
                          "train.optim.lr": args.grpo_lr, "train.optim.schedule": f'"{args.grpo_schedule}"'})
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
        t0 = time.monotonic()
        weights = train(args, work, name + suffix, sets, continue_from=work / "sft" if continue_sft else None)
        check_trained_on(work / (name + suffix), train_tasks)
        timings[f"{name}_s"] = time.monotonic() - t0
        curves[name] = curve(work / (name + suffix), after=args.sft_steps if continue_sft else 0)
        rates[f"train_after_{name}"] = evaluate(args, weights, work / "train.jsonl", work / f"eval-{name}{suffix}",
                                                seed_offset=0 if name == "grpo" else 1)
        if name == "grpo":
            rates["test_after_grpo"] = evaluate(args, weights, work / "test.jsonl", work / f"eval-grpo{suffix}-test",
                                                 args.test_samples)

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
