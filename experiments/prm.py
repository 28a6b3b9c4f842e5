"""`just experiment prm`: process rewards on this CPU machine, end to end, with a judge that was trained to judge.

An untrained tiny model never writes ``\\boxed{...}``, so a PRM run with it only shows that unparseable votes are
counted. This suite makes a judge whose votes mean something and measures them. The run is the recipe
experiments/recipes/prm.toml (`swectl up --recipe`, through benchmarks/recipe_run.py):

1. judge data: ``swectl data judge`` over recorded episodes (``--judge-data``: run folders of `swectl eval` on the
   train split, e.g. a first run's eval-sft), labelling the steps the outcome settles (swectl/data/judge.py);
2. the judge: SFT of ``--judge-base`` on that data;
3. a GRPO run with ``[reward.prm]`` served by that judge as its own engine group, the first run's episode settings;
4. the judge read back here: its statistics (steps, votes, unparseable answers, failures: the run's prm/* metrics and
   every traj.json's ``step_judgements``) and its agreement with the labels the outcome rules give the run's own
   (fresh, unseen) episodes: a step the judge scores > 0 against a good label, < 0 against a bad one.

Writes ``benchmarks/results/prm.json`` (one entry per run, keyed ``<work>:grpo-prm[-<tag>]``) and keeps the run
folder (``--work``; with ``--tag``, ``<work>-<tag>``). ``--judge WEIGHTS`` reuses a judge trained before (the
recipe's judge phases dropped) and ``--grpo-set`` changes the GRPO phase alone, e.g. asynchronous with per-step
samples.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmarks' host_meta and recipe runner
sys.path.insert(0, str(REPO / "experiments"))

import recipe_run  # noqa: E402
from common import host_meta  # noqa: E402

from swectl.agent.loop import Episode  # noqa: E402
from swectl.cli.phases import JUDGE_DATA_FILE  # noqa: E402
from swectl.data.judge import step_labels  # noqa: E402
from swectl.data.trajectories import META_FILE, read_meta  # noqa: E402
from swectl.rl.prm import StepJudgement  # noqa: E402
from swectl.train.checkpoint import latest_checkpoint  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "prm.json"


class _Traj(msgspec.Struct):
    """The parts of a training episode's traj.json this suite reads."""

    episode: Episode
    step_judgements: list[StepJudgement] = []


def say(message: str) -> None:
    print(f"prm: {message}", file=sys.stderr, flush=True)


def final_weights(phase_dir: Path) -> Path:
    latest = latest_checkpoint(phase_dir)
    if latest is None:
        raise SystemExit(f"prm: {phase_dir} ended without a checkpoint")
    return Path(latest[1].weights)


def derived_lines(judge: Path | None, grpo_sets: list[str]) -> list[str]:
    """The TOML lines of a recipe extending prm.toml: its judge phases dropped for a judge trained before, and the
    GRPO phase's own config keys (``KEY=VALUE``, values as TOML)."""
    lines: list[str] = []
    if judge is not None:
        lines.append('drop = ["judge-data", "judge"]')
    if judge is None and not grpo_sets:
        return lines
    lines += ["[[phase]]", 'name = "grpo-prm"', *(["after = []"] if judge is not None else []), "[phase.config]"]
    if judge is not None:
        lines.append(f"reward.prm.model = {json.dumps(str(judge))}")
    for item in grpo_sets:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"prm: --grpo-set wants KEY=VALUE, got {item!r}")
        lines.append(f"{key.strip()} = {value.strip()}")
    return lines


def agreement(run_dir: Path) -> dict[str, object]:
    """The judge's verdicts in a run's episodes against the outcome rules' labels (swectl/data/judge.py)."""
    counts = {"episodes": 0, "steps": 0, "judged": 0, "scored": 0, "votes": 0, "unparseable": 0, "failures": 0,
              "labelled": 0, "good_labels": 0, "bad_labels": 0, "good_agree": 0, "bad_agree": 0, "ties": 0,
              "malformed_labels": 0, "malformed_agree": 0, "submission_labels": 0, "submission_agree": 0}
    score_by_outcome: dict[str, list[float]] = {"resolved": [], "unresolved": []}
    for path in sorted(run_dir.glob("episodes/*/*/traj.json")):
        traj = msgspec.json.decode(path.read_bytes(), type=_Traj)
        meta = read_meta(path.parent / META_FILE, required_by="the judge's agreement")
        resolved = meta is not None and meta.resolved
        counts["episodes"] += 1
        counts["steps"] += len(traj.episode.steps)
        labels = step_labels(traj.episode, resolved)
        for judged in traj.step_judgements:
            counts["judged"] += 1
            counts["votes"] += len(judged.votes)
            counts["unparseable"] += judged.unparseable
            counts["failures"] += judged.failures
            if judged.score is None:
                continue
            counts["scored"] += 1
            score_by_outcome["resolved" if resolved else "unresolved"].append(judged.score)
            if judged.step not in labels:
                continue
            label, reason = labels[judged.step]
            counts["labelled"] += 1
            counts["good_labels" if label > 0 else "bad_labels"] += 1
            if reason != "resolved":
                counts[f"{reason}_labels"] += 1
            if judged.score == 0:
                counts["ties"] += 1
            elif (judged.score > 0) == (label > 0):
                counts["good_agree" if label > 0 else "bad_agree"] += 1
                if reason != "resolved":
                    counts[f"{reason}_agree"] += 1

    def frac(a: str, b: str) -> float | None:
        return round(counts[a] / counts[b], 4) if counts[b] else None

    answers = counts["votes"] + counts["unparseable"] + counts["failures"]
    return {**counts,
            "unparseable_frac": round(counts["unparseable"] / answers, 4) if answers else None,
            "scored_frac": frac("scored", "judged"),
            "accuracy": (round((counts["good_agree"] + counts["bad_agree"]) / counts["labelled"], 4)
                         if counts["labelled"] else None),
            "accuracy_good": frac("good_agree", "good_labels"), "accuracy_bad": frac("bad_agree", "bad_labels"),
            "accuracy_bad_malformed": frac("malformed_agree", "malformed_labels"),
            "accuracy_bad_submission": frac("submission_agree", "submission_labels"),
            "mean_score_resolved_episodes": _mean(score_by_outcome["resolved"]),
            "mean_score_unresolved_episodes": _mean(score_by_outcome["unresolved"])}


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def prm_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k == "step" or k.startswith("prm/") or k in ("reward_mean", "resolve_rate")}
            for r in rows if "reward_mean" in r]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("runs/prm"), help="the run folder (default runs/prm)")
    parser.add_argument("--tasks", type=Path, required=True,
                        help="the train split the episodes ran on (a first run's RUN/train.jsonl)")
    parser.add_argument("--judge-data", type=Path, nargs="+", required=True, metavar="RUN",
                        help="run folders of episodes to label (e.g. a first run's eval-sft)")
    parser.add_argument("--policy", type=Path, required=True, help="the GRPO start: e.g. a first run's SFT weights")
    parser.add_argument("--judge-base", type=Path, default=None,
                        help="the model the judge is fine-tuned from (default: --policy)")
    parser.add_argument("--judge", type=Path, default=None, metavar="WEIGHTS",
                        help="a judge trained before (its weights folder): the judge phases are left out")
    parser.add_argument("--judge-steps", type=int, default=150)
    parser.add_argument("--judge-lr", type=float, default=1e-3)
    parser.add_argument("--grpo-steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=3, help="judge answers per step (reward.prm.samples)")
    parser.add_argument("--step-coef", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config key of the GRPO phase alone (values as TOML; e.g. "
                        "train.sampling.max_staleness=1, train.sampling.sample_mode='\"step\"', "
                        "experiment.step_score_advantage=0.5)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a `swectl up --set` of every phase (recipe.NAME=VALUE: one of prm.toml's vars)")
    parser.add_argument("--tag", default="", help="suffix of the run folder and of the results key")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    work = args.work.resolve()
    if args.tag:
        work = work.with_name(f"{work.name}-{args.tag}")
    recipe = recipe_run.derived(work.parent / f"{work.name}.recipe.toml", "prm",
                                derived_lines(args.judge.resolve() if args.judge else None, args.grpo_set))
    vars_ = {"tasks": str(args.tasks.resolve()), "judge_data": [str(p.resolve()) for p in args.judge_data],
             "policy": str(args.policy.resolve()), "judge_base": str((args.judge_base or args.policy).resolve()),
             "judge_steps": args.judge_steps, "judge_lr": args.judge_lr, "grpo_steps": args.grpo_steps,
             "samples": args.samples, "step_coef": args.step_coef, "seed": args.seed}
    summary = recipe_run.run(recipe, work, [*recipe_run.var_sets(vars_), *args.sets], say)
    grpo = final_weights(work / "grpo-prm")
    judge = args.judge or final_weights(work / "judge")
    data = work / "judge-data" / JUDGE_DATA_FILE
    rows = [json.loads(line) for line in data.read_text().splitlines()] if args.judge is None else []
    labels = {"good": sum(r["label"] > 0 for r in rows), "bad": sum(r["label"] < 0 for r in rows)}
    run_id = "grpo-prm" + (f"-{args.tag}" if args.tag else "")
    result = {"settings": json.loads(json.dumps(vars(args), default=str)),  # Paths as strings
              "recipe": "experiments/recipes/prm.toml", "vars": summary.vars,
              "judge_data": {"rows": len(rows), **labels}, "judge_weights": str(judge), "grpo_weights": str(grpo),
              "judge": agreement(work / "grpo-prm"), "curve": prm_metrics(work / "grpo-prm"),
              "timings_s": {"judge_sft_s": summary.phases_s.get("judge"),
                            "grpo_prm_s": summary.phases_s.get("grpo-prm")},
              "phases_s": summary.phases_s, "meta": host_meta()}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    report = json.loads(args.results.read_text()) if args.results.exists() else {}
    report.setdefault("suite", "prm")
    report.setdefault("runs", {})[f"{args.work.name}:{run_id}"] = result  # one file, one entry per run
    report["latest"] = f"{args.work.name}:{run_id}"
    args.results.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(result["judge"], indent=1))
    say(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
