"""`just bench learn_harness`: does the policy learn through an unmodified agent harness (issue 58)?

For each ``--seed``: the bundled ``first-run-control`` recipe (the first run, and its GRPO again from the same SFT
weights with each group's rewards shuffled, read the same way) with ``--set agent.harness="mini-swe-agent"``: the
harness's own process runs every episode (the teachers' SFT data, GRPO's rollouts and the readings), its model
calls through the gateway, its commands in swectl's sandboxes, its config swectl's prompt in mini's format
(agent.harness_config = "swectl": the tiny model's chat template renders no tools). The gain is GRPO's train
reading minus SFT's; the control's must not rise.

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

import recipe_run

from swectl.actors.metrics import METRICS_FILE, read_metrics

RESULTS = Path(__file__).resolve().parent / "results" / "learn_harness.json"
RECIPE = "first-run-control"
HARNESS_SETS = ['agent.harness="mini-swe-agent"', 'agent.harness_config="swectl"']


def say(message: str) -> None:
    print(f"learn_harness: {message}", file=sys.stderr, flush=True)


def gateway_counts(run: Path) -> dict[str, float]:
    """A training run's gateway readings summed over its steps (metrics.jsonl)."""
    totals: dict[str, float] = {}
    records, _ = read_metrics(run / METRICS_FILE) if (run / METRICS_FILE).exists() else ([], [])
    for row in records:
        for key, value in row.items():
            if key.startswith("gateway/"):
                totals[key] = totals.get(key, 0.0) + value
    return totals


def one_seed(work: Path, seed: int, sets: list[str]) -> dict[str, Any]:
    run_dir = (work / f"seed{seed}").resolve()
    t0 = time.monotonic()
    s = recipe_run.run(RECIPE, run_dir, [*recipe_run.var_sets({"seed": seed}), *sets, *HARNESS_SETS], say)
    r = s.readings
    return {"seed": seed, "run_dir": str(run_dir),
            "sft_train_pct": round(100 * r["sft_train"].resolve_rate, 1),
            "grpo_train_pct": round(100 * r["grpo_train"].resolve_rate, 1),
            "shuffled_train_pct": round(100 * r["shuffled_train"].resolve_rate, 1),
            "test_pct": round(100 * r["test"].resolve_rate, 1),
            "gain_points": s.gain_points, "gain_noise_points": s.gain_noise_points,
            "shuffled_gain_points": s.control_gain_points, "shuffled_gain_noise_points": s.control_noise_points,
            "episodes_per_reading": r["sft_train"].episodes,
            "gateway_grpo": gateway_counts(run_dir / "grpo"),
            "gateway_shuffled": gateway_counts(run_dir / "grpo-shuffled"),
            "minutes": s.minutes, "this_call_minutes": round((time.monotonic() - t0) / 60, 1),
            "phases_s": s.phases_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, action="append", help="repeatable (default: 0 and 1)")
    parser.add_argument("--work", type=Path, default=Path("runs/learn-harness"))
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a `swectl up --set` for every seed's run: recipe.NAME=VALUE sets one of the recipe's "
                             "vars (e.g. recipe.grpo_steps=30), any other key the config (repeatable)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    seeds = []
    for seed in args.seed or [0, 1]:
        seeds.append(one_seed(args.work, seed, args.sets))
        say(json.dumps(seeds[-1]))
    # the file keeps the seeds of earlier calls (and its other keys): a call with one seed replaced them all once
    kept = json.loads(args.results.read_text()) if args.results.exists() else {}
    ran = {s["seed"] for s in seeds}
    earlier = [s for s in kept.get("seeds", []) if s.get("seed") not in ran]
    for s in seeds:
        s.update(date=time.strftime("%Y-%m-%d"), sets=args.sets)
    result = {**kept, "benchmark": "learn_harness", "harness": "mini-swe-agent 2.4.6", "harness_config": "swectl",
              "recipe": RECIPE, "seeds": sorted([*earlier, *seeds], key=lambda s: s["seed"])}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    say(f"wrote {args.results}")
    for s in seeds:
        say(f"seed {s['seed']}: SFT {s['sft_train_pct']}% -> GRPO {s['grpo_train_pct']}% ({s['gain_points']:+} "
            f"+/- {s['gain_noise_points']}); shuffled {s['shuffled_train_pct']}% ({s['shuffled_gain_points']:+} +/- "
            f"{s['shuffled_gain_noise_points']}); {s['minutes']} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
