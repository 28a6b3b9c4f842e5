"""`just learn`: does the policy learn, on this CPU machine? The first run with larger readings and its controls.

The run is the recipe experiments/recipes/learn.toml, run by `swectl up --recipe` (it extends the bundled first run):

1. the tiny model and the seeded train / held-out split of the bundled tasks;
2. the first run's SFT data (gold trajectories and the noisy teacher's give-up and recover copies), and SFT on it to
   a checkpoint that edits on some tries and gives up on others: only the reward says which attempts are right;
3. the first run's GRPO from the SFT weights, and control runs of it from the same weights, so any gain of the real
   run is shown to come from the reward: every advantage zeroed (experiment.zero_advantages: no update at all; the
   default control, ``--controls zero``) and each group's rewards shuffled (experiment.shuffle_rewards: updates as
   large as the real run's, blind to which episode resolved its task; ``--controls zero,shuffle``);
4. sampled readings (temperature 1, seeded): the train split before training (2 episodes per task), after SFT, after
   GRPO and after each control (8), and the held-out split after GRPO (4).

Every sample is seeded: the GRPO rollouts by train.seed, the readings by ``--eval-seed`` (the controls' by that + 1).
So a rerun with the same seed draws the same random numbers, up to float rounding in the engine's batches and the
timing of asynchronous GRPO.
   The zero-advantage control makes no update, so its final weights are the SFT weights: when their sha256 agree,
   the SFT and control readings are pooled into one estimate of the SFT policy (``train_after_sft_pooled_pct``)
   and GRPO's gain is also reported against it (``grpo_gain_vs_pooled_sft_points``, the less noisy reading).

Any of the recipe's numbers is ``--set recipe.NAME=VALUE`` (its vars: swectl/data/bundled/recipes/first-run.toml and
experiments/recipes/learn.toml), any config key ``--set KEY=VALUE`` (every phase's). Writes
``benchmarks/results/learn.json`` (rates, per-step GRPO curves of the runs, minutes per phase, the seed) and keeps
the run folder (``--work``, default runs/learn-seed<seed>; a rerun goes on from its finished phases).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # the suites' recipe runner

import recipe_run  # noqa: E402

from swectl.config import toml_value  # noqa: E402
from swectl.train.recipe import Reading  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "learn.json"
CONTROLS = {"zero": ("grpo-zero", "eval-zero", "zero_train"), "shuffle": ("grpo-shuffled", "eval-shuffled",
                                                                          "shuffled_train")}


def say(message: str) -> None:
    print(f"learn: {message}", file=sys.stderr, flush=True)


def weights_digest(weights: Path) -> str:
    """sha256 over a weights folder's safetensors files (names and bytes): equal digests, equal policies."""
    digest = hashlib.sha256()
    for path in sorted(weights.glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def pooled_sft(readings: dict[str, Reading]) -> dict | None:
    """The SFT policy's rate from every reading of it: the SFT reading and, when the zero-advantage control's final
    weights are the SFT weights byte for byte (it made no update), the control's reading too. Two readings of one
    policy are one sample twice as large; None when there is nothing to pool."""
    sft, control = readings.get("sft_train"), readings.get("zero_train")
    if sft is None or control is None:
        return None
    if weights_digest(Path(sft.model)) != weights_digest(Path(control.model)):
        return None
    resolved, episodes = sft.resolved + control.resolved, sft.episodes + control.episodes
    return {"resolve_rate": round(resolved / episodes, 4), "resolved": resolved, "episodes": episodes,
            "evaluations": [sft.folder, control.folder]}


def check_trained_on(run_dir: Path, train_split: Path) -> None:
    """Stop unless every task the run trained on (its steps.jsonl) is one of the train split: the readings read the
    train split, and a run that trained on held-out tasks would make the test reading moot (a ``--set
    train.data.tasks=...`` could do that)."""
    allowed = {json.loads(line)["instance_id"] for line in train_split.read_text().splitlines() if line.strip()}
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
                        help="sampling seed of the readings (default: --seed); the controls' readings use N+1, so "
                             "pooled with the SFT's they add new episodes")
    parser.add_argument("--work", type=Path, default=None, help="the run folder (default runs/learn-seed<seed>)")
    parser.add_argument("--controls", default="zero",
                        help="control runs, comma-separated: zero (advantages zeroed), shuffle (rewards shuffled); "
                             "'' for none")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a `swectl up --set`: recipe.NAME=VALUE sets one of the recipe's vars (e.g. "
                             "recipe.grpo_steps=30, recipe.eval_samples=4), any other key the config of every "
                             "phase (repeatable)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    controls = [c for c in args.controls.split(",") if c]
    if unknown := [c for c in controls if c not in CONTROLS]:
        parser.error(f"--controls: unknown {', '.join(unknown)} (choose from {', '.join(CONTROLS)})")
    eval_seed = args.seed if args.eval_seed is None else args.eval_seed
    work = (args.work or Path("runs") / f"learn-seed{args.seed}").resolve()
    dropped = [phase for name, (train, read, _) in CONTROLS.items() if name not in controls for phase in (train, read)]
    recipe = recipe_run.derived(work.parent / f"{work.name}.recipe.toml", "learn",
                                [f"drop = {toml_value(dropped)}"] if dropped else [])
    vars_ = {"seed": args.seed, "eval_seed": eval_seed, "control_eval_seed": eval_seed + 1}
    summary = recipe_run.run(recipe, work, [*recipe_run.var_sets(vars_), *args.sets], say)
    readings = summary.readings
    curves = {}
    for name in ["grpo", *(CONTROLS[c][0] for c in controls)]:
        check_trained_on(work / name, work / "train.jsonl")
        curves[name] = curve(work / name)

    def pct(key: str) -> float | None:  # None (JSON null) for a reading not taken (a control not asked for)
        return round(100 * readings[key].resolve_rate, 1) if key in readings else None

    def gain(key: str) -> float | None:
        after, before = pct(key), pct("sft_train")
        return round(after - before, 1) if after is not None and before is not None else None

    pooled = pooled_sft(readings)
    result = {
        "seed": args.seed, "eval_seed": eval_seed, "controls": controls, "sets": args.sets, "vars": summary.vars,
        "recipe": "experiments/recipes/learn.toml",
        "resolve_rate_pct": {k: pct(k) for k in readings},
        "grpo_gain_points": gain("grpo_train"), "gain_noise_points": summary.gain_noise_points,
        "control_gain_points": gain("zero_train"), "shuffle_control_gain_points": gain("shuffled_train"),
        "train_after_sft_pooled_pct": None if pooled is None else round(100 * pooled["resolve_rate"], 1),
        "grpo_gain_vs_pooled_sft_points": (None if pooled is None or pct("grpo_train") is None
                                           else round(pct("grpo_train") - 100 * pooled["resolve_rate"], 1)),
        "sft_pooled": pooled, "readings": {k: msgspec.to_builtins(v) for k, v in readings.items()},
        "curves": curves, "phases_s": summary.phases_s, "total_minutes": summary.minutes, "work": str(work),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.results.read_text()) if args.results.exists() else {}
    runs_by_key = previous.get("runs", {}) if isinstance(previous, dict) else {}
    runs_by_key[f"seed{args.seed}:{work.name}"] = result
    kept = previous if isinstance(previous, dict) else {}  # other keys (a file's notes) stay as they are
    args.results.write_text(json.dumps({**kept, "runs": runs_by_key, "latest": result}, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("seed", "resolve_rate_pct", "grpo_gain_points", "control_gain_points",
                                                "shuffle_control_gain_points", "train_after_sft_pooled_pct",
                                                "grpo_gain_vs_pooled_sft_points", "total_minutes")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
