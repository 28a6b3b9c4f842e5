"""just bench async: the asynchronous RL loop's scheduler on its own, in simulated time (swectl/testing/async_sim.py
driving the real admission rules of swectl/rl/admission.py), at equal samples trained.

For each episode-duration spread, the synchronous loop (max_staleness 0) and bounded staleness k = 1 and 2, next
to the drop-stale alternative (groups start whenever a slot frees, samples staler than k are thrown away):
wall time (speedup over synchronous), trainer and slot idle fractions, the staleness of the trained samples, and
the mean reward of the trained samples against the population's (every sample the run drew), where a bias
toward fast episodes shows. Several seeds per setting; the metrics are their means.

Spreads: ``demo`` is the learning demo's own (learn-rep2's GRPO episodes on this machine: median 12.8 s, log-sd
0.49; trainer step about 6 s); ``agentic`` widens it to log-sd 1.0 (episodes from seconds to minutes, as real SWE
agents run), the case the goal is written for. Writes benchmarks/results/async.json: ``async_speedup_k1``,
``async_speedup_k2``, ``admitted_reward_bias`` (k = 2), ``trainer_idle_frac_k2`` (agentic spread), the same keys
with a ``demo_`` prefix, and the drop-stale rows in meta.

``--runs SYNC_RUN ASYNC_RUN`` adds the real thing: two `swectl up` GRPO run folders of one setting on this machine,
synchronous and asynchronous (e.g. the grpo folders of `just learn --set recipe.max_staleness=0` and of
`just learn`, whose recipe is asynchronous):
GRPO steps per hour of each (from the steps' wall times), their ratio, and the async run's mean staleness and
trainer wait (``real_*`` keys).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from common import Goal, Progress, format_table, host_meta, report  # noqa: E402

from swectl.testing.async_sim import SimConfig, SimResult, simulate  # noqa: E402

SPREADS = {"agentic": 1.0, "demo": 0.49}
MU = math.log(12.8)  # median episode of the demo's GRPO steps, seconds
TRAIN_S = 6.0  # the demo's trainer step (train + weight sync), seconds
SETTINGS = [("bounded", 0), ("bounded", 1), ("bounded", 2), ("drop_stale", 1), ("drop_stale", 2)]


def run_setting(policy: str, k: int, sigma: float, steps: int, seeds: int) -> dict:
    """Mean over ``seeds`` simulated runs of one setting."""
    runs: list[SimResult] = [simulate(SimConfig(policy=policy, max_staleness=k, sigma=sigma, mu=MU, train_s=TRAIN_S,
                                                steps=steps, seed=seed)) for seed in range(seeds)]
    staleness: dict[int, int] = {}
    for r in runs:
        for s, n in r.staleness.items():
            staleness[s] = staleness.get(s, 0) + n
    trained = sum(r.samples_trained for r in runs)
    return {
        "policy": policy, "max_staleness": k, "sigma": sigma, "seeds": seeds, "steps": steps,
        "wall_s": statistics.mean(r.wall_s for r in runs),
        "trainer_idle_frac": round(statistics.mean(r.trainer_idle_frac for r in runs), 4),
        "slot_idle_frac": round(statistics.mean(r.slot_idle_frac for r in runs), 4),
        "reward_bias": round(statistics.mean(r.reward_bias for r in runs), 4),
        "reward_bias_sd": round(statistics.stdev(r.reward_bias for r in runs), 4) if seeds > 1 else 0.0,
        "dropped_frac": round(sum(r.samples_dropped for r in runs) / (trained + sum(r.samples_dropped for r in runs)),
                              4),
        "staleness_frac": {s: round(n / trained, 4) for s, n in sorted(staleness.items())},
        "max_staleness_seen": max(staleness),
    }


def real_runs(sync_run: Path, async_run: Path) -> dict[str, float]:
    """Steps per hour of two GRPO runs (the sum of their steps' wall times) and the async one's staleness."""
    def steps(run: Path) -> list[dict]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        rows = [r for r in rows if "step_s" in r]
        if not rows:
            raise SystemExit(f"{run}/metrics.jsonl has no steps")
        return rows

    sync, fast = steps(sync_run), steps(async_run)
    per_hour = {name: 3600 * len(rows) / sum(r["step_s"] for r in rows) for name, rows in (("sync", sync),
                                                                                          ("async", fast))}
    return {
        "real_steps_per_hour_sync": round(per_hour["sync"], 2),
        "real_steps_per_hour_async": round(per_hour["async"], 2),
        "real_async_speedup": round(per_hour["async"] / per_hour["sync"], 3),
        "real_async_staleness_mean": round(statistics.mean(r.get("staleness_mean", 0.0) for r in fast), 3),
        "real_async_trainer_wait_frac": round(sum(r.get("trainer_wait_s", 0.0) for r in fast)
                                              / sum(r["step_s"] for r in fast), 3),
        "real_sync_rollout_frac": round(sum(r.get("rollout_s", 0.0) for r in sync) / sum(r["step_s"] for r in sync),
                                        3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="trainer steps per simulated run (default 2000)")
    parser.add_argument("--seeds", type=int, default=5, help="simulated runs per setting (default 5)")
    parser.add_argument("--quick", action="store_true", help="300 steps, 2 seeds")
    parser.add_argument("--runs", nargs=2, type=Path, metavar=("SYNC_RUN", "ASYNC_RUN"),
                        help="two `swectl up` GRPO run folders of one setting, synchronous and asynchronous: their "
                             "steps per hour on this machine")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = 300, 2
    say = Progress("async")
    rows: dict[str, dict[str, dict]] = {}
    for spread, sigma in SPREADS.items():
        for policy, k in SETTINGS:
            rows.setdefault(spread, {})[f"{policy}_k{k}"] = run_setting(policy, k, sigma, args.steps, args.seeds)
        say(f"{spread} spread (log-sd {sigma}) simulated")
    metrics: dict[str, float] = {}
    for spread in SPREADS:
        r = rows[spread]
        prefix = "" if spread == "agentic" else f"{spread}_"
        sync = r["bounded_k0"]["wall_s"]
        metrics[f"{prefix}async_speedup_k1"] = round(sync / r["bounded_k1"]["wall_s"], 3)
        metrics[f"{prefix}async_speedup_k2"] = round(sync / r["bounded_k2"]["wall_s"], 3)
        metrics[f"{prefix}admitted_reward_bias"] = r["bounded_k2"]["reward_bias"]
        metrics[f"{prefix}trainer_idle_frac_k2"] = r["bounded_k2"]["trainer_idle_frac"]
        metrics[f"{prefix}drop_stale_reward_bias_k1"] = r["drop_stale_k1"]["reward_bias"]
    table = [(spread, name, f"{sync_ratio:.2f}", f"{row['trainer_idle_frac']:.3f}", f"{row['slot_idle_frac']:.3f}",
              f"{row['reward_bias']:+.4f}", f"{row['dropped_frac']:.3f}", str(row["max_staleness_seen"]))
             for spread in SPREADS for name, row in rows[spread].items()
             for sync_ratio in [rows[spread]["bounded_k0"]["wall_s"] / row["wall_s"]]]
    print(format_table(("spread", "policy", "speedup", "trainer idle", "slot idle", "reward bias", "dropped",
                        "max staleness"), table))
    print()
    metrics["admitted_reward_bias_abs"] = abs(metrics["admitted_reward_bias"])
    if args.runs:
        metrics.update(real_runs(*args.runs))
    goals = [
        Goal("async_speedup_k2", ">=", 2.0, text=">= 2 (agentic spread)"),
        Goal("admitted_reward_bias_abs", "<=", 0.02, text="<= 0.02 (relative to the population's mean)"),
    ]
    meta = {**host_meta(), "runs": [str(r) for r in args.runs or []],
            "steps": args.steps, "seeds": args.seeds, "episode_median_s": round(math.exp(MU), 2),
            "train_step_s": TRAIN_S, "spreads": SPREADS, "settings": rows,
            "model": "simulated time: lognormal episodes (failures x1.5 slower), Beta(2,2) task solve rates, groups "
                     "of 4, 4 groups a step, 8 rollout slots"}
    report("async", metrics, meta, goals)
    return 0


if __name__ == "__main__":
    sys.exit(main())
