"""`just bench learn_harness`: does the policy learn through an unmodified agent harness (issue 58)?

For each ``--seed``: the first run (`swectl up` with no config file; swectl/train/first_run.py) with
``--set agent.harness="mini-swe-agent"``: the harness's own process runs every episode (the teachers' SFT data, GRPO's
rollouts and the readings), its model calls through the gateway, its commands in swectl's sandboxes, its config
swectl's prompt in mini's format (agent.harness_config = "swectl": the tiny model's chat template renders no tools).
Then the control: the same GRPO from the same SFT weights with each group's rewards shuffled
(experiment.shuffle_rewards: updates as large as the real run's, blind to which episode resolved its task), read the
same way. The gain is GRPO's train reading minus SFT's; the control's must not rise.

Every run folder is kept under ``--work`` (default runs/learn-harness); a rerun goes on from the phases that finished.
Writes ``benchmarks/results/learn_harness.json``: per seed the readings, the gains with their noise (one standard
error of a difference of two binomial readings), the gateway's branch counts and the minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from swectl.config import apply_override
from swectl.train import first_run
from swectl.train.first_run import Recipe

RESULTS = Path(__file__).resolve().parent / "results" / "learn_harness.json"
HARNESS_SETS = ["--set", 'agent.harness="mini-swe-agent"', "--set", 'agent.harness_config="swectl"']


def say(message: str) -> None:
    print(f"learn_harness: {message}", file=sys.stderr, flush=True)


def gateway_counts(run: Path) -> dict[str, float]:
    """The GRPO run's gateway readings summed over its steps (metrics.jsonl)."""
    totals: dict[str, float] = {}
    path = run / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        for key, value in row.items():
            if key.startswith("gateway/"):
                totals[key] = totals.get(key, 0.0) + value
    return totals


def one_seed(work: Path, seed: int, recipe_overrides: dict[str, Any]) -> dict[str, Any]:
    run_dir = work / f"seed{seed}"
    recipe = first_run.load_recipe(run_dir, {**recipe_overrides, "seed": seed})
    t0 = time.monotonic()
    summary = first_run.run_first(run_dir, recipe, HARNESS_SETS, say)
    real_s = time.monotonic() - t0
    sft_weights = Path(summary.readings["sft_train"]["model"])
    extra = [*first_run.set_flags(recipe.rollout_sets()), *HARNESS_SETS]
    t0 = time.monotonic()
    sets = {**recipe.grpo_sets(sft_weights), "experiment.shuffle_rewards": "true"}
    control_weights = first_run.train(run_dir, "grpo-shuffled", sets, say, extra=extra)
    control = first_run.evaluate(recipe, control_weights, run_dir / "train.jsonl", run_dir / "eval-shuffled",
                                 recipe.eval_samples, say, extra=HARNESS_SETS)
    control_s = time.monotonic() - t0
    sft = summary.readings["sft_train"]
    return {"seed": seed, "run_dir": str(run_dir),
            "sft_train_pct": round(100 * sft["resolve_rate"], 1),
            "grpo_train_pct": round(100 * summary.grpo_train_resolve_rate, 1),
            "shuffled_train_pct": round(100 * control["resolve_rate"], 1),
            "test_pct": round(100 * summary.test_resolve_rate, 1),
            "gain_points": summary.gain_points, "gain_noise_points": summary.gain_noise_points,
            "shuffled_gain_points": round(100 * (control["resolve_rate"] - sft["resolve_rate"]), 1),
            "shuffled_gain_noise_points": first_run.noise_points(sft, control),
            "episodes_per_reading": sft["episodes"],
            "gateway_grpo": gateway_counts(run_dir / "grpo"),
            "gateway_shuffled": gateway_counts(run_dir / "grpo-shuffled"),
            "first_run_minutes": summary.minutes, "this_call_minutes": round(real_s / 60, 1),
            "control_minutes": round(control_s / 60, 1), "phases_s": summary.phases_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, action="append", help="repeatable (default: 0 and 1)")
    parser.add_argument("--work", type=Path, default=Path("runs/learn-harness"))
    parser.add_argument("--recipe", action="append", default=[], metavar="KEY=VALUE",
                        help="a first-run recipe field (recipe.KEY), e.g. grpo_steps=30 (repeatable)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    document: dict[str, Any] = {}
    for item in args.recipe:  # values parse as TOML, as `swectl up --set recipe.KEY=VALUE` takes them
        apply_override(document, f"recipe.{item}")
    overrides = document.get("recipe", {})
    msgspec.convert(overrides, Recipe)  # a wrong field stops here
    seeds = []
    for seed in args.seed or [0, 1]:
        seeds.append(one_seed(args.work, seed, overrides))
        say(json.dumps(seeds[-1]))
    result = {"benchmark": "learn_harness", "date": time.strftime("%Y-%m-%d"), "harness": "mini-swe-agent 2.4.6",
              "harness_config": "swectl", "recipe_overrides": overrides, "seeds": seeds}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    say(f"wrote {args.results}")
    for s in seeds:
        say(f"seed {s['seed']}: SFT {s['sft_train_pct']}% -> GRPO {s['grpo_train_pct']}% ({s['gain_points']:+} "
            f"+/- {s['gain_noise_points']}); shuffled {s['shuffled_train_pct']}% ({s['shuffled_gain_points']:+} +/- "
            f"{s['shuffled_gain_noise_points']}); {s['first_run_minutes']} + {s['control_minutes']} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
