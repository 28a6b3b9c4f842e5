"""`just experiment prm`: process rewards on this CPU machine, end to end, with a judge that was trained to judge.

An untrained tiny model never writes ``\\boxed{...}``, so a PRM run with it only shows that unparseable votes are
counted. This suite makes a judge whose votes mean something and measures them:

1. judge data: ``swectl data judge`` over recorded episodes of the learning demo (``--judge-data``: run folders of
   `swectl eval --model` on the train split), labelling the steps the outcome settles (swectl/data/judge.py);
2. the judge: SFT (`swectl up`, train.algorithm = "sft") of ``--judge-base`` on that data;
3. a GRPO run with ``[reward.prm]`` served by that judge as its own engine group, the demo's settings otherwise;
4. the judge read back: its statistics (steps, votes, unparseable answers, failures: the run's prm/* metrics and
   every traj.json's ``step_judgements``) and its agreement with the labels the outcome rules give the run's own
   (fresh, unseen) episodes: a step the judge scores > 0 against a good label, < 0 against a bad one.

Writes ``benchmarks/results/prm.json`` (one entry per GRPO run, keyed ``<work>:<run>``; ``--tag`` and ``--grpo-set``
make another run with the same judge, e.g. asynchronous with per-step samples) and keeps the run folders under
``--work``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmarks' host_meta
sys.path.insert(0, str(REPO / "experiments"))

from common import host_meta  # noqa: E402

from swectl.agent.loop import Episode  # noqa: E402
from swectl.config import apply_override  # noqa: E402
from swectl.data.judge import step_labels  # noqa: E402
from swectl.data.trajectories import META_FILE, read_meta  # noqa: E402
from swectl.rl.prm import StepJudgement  # noqa: E402
from swectl.train import recipe as recipes  # noqa: E402
from swectl.train.checkpoint import latest_checkpoint  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "prm.json"
SWECTL = [sys.executable, "-m", "swectl.cli.main"]


class _Traj(msgspec.Struct):
    """The parts of a training episode's traj.json this suite reads."""

    episode: Episode
    step_judgements: list[StepJudgement] = []


def say(message: str) -> None:
    print(f"prm: {message}", file=sys.stderr, flush=True)


def swectl(argv: list[str], what: str) -> None:
    say(f"{what}: swectl {' '.join(argv)}")
    if subprocess.run([*SWECTL, *argv]).returncode != 0:
        raise SystemExit(f"prm: {what} failed")


def first_run_episodes() -> dict[str, object]:
    """The first run's episode settings (its overlay's [rollout] and [env_pool]: step limit, tokens, context,
    prompts), as a nested table: this suite's GRPO plays its episodes the same way."""
    first = recipes.load("first-run", {})
    overlay = recipes.fill(first.file.config, first.vars, "config")
    return {key: overlay[key] for key in ("rollout", "env_pool")}


def up(work: Path, run_id: str, document: dict[str, object]) -> Path:
    """One `swectl up` run of the config ``document`` (a nested overlay) in ``work/run_id`` (resumed, or left as it
    is, when it has a checkpoint); its final weights."""
    folder = work / run_id
    if (folder / "checkpoints" / "latest").exists():
        steps = document["train"]["steps"]  # type: ignore[index]
        swectl(["up", "--resume", str(folder), "--steps", str(steps)], f"train {run_id}")
    else:
        swectl(["up", "--recipe", "train", *recipes.set_flags({"out_dir": str(work), "run_id": run_id, **document})],
               f"train {run_id}")
    latest = latest_checkpoint(folder)
    if latest is None:
        raise SystemExit(f"prm: {folder} ended without a checkpoint")
    return Path(latest[1].weights)


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
    parser.add_argument("--work", type=Path, default=Path("runs/prm"), help="folder for the data and every run")
    parser.add_argument("--tasks", type=Path, required=True,
                        help="the train split the episodes ran on (the learning demo's WORK/train.jsonl)")
    parser.add_argument("--judge-data", type=Path, nargs="+", required=True, metavar="RUN",
                        help="run folders of episodes to label (e.g. the demo's eval-sft)")
    parser.add_argument("--policy", type=Path, required=True, help="the GRPO start: the demo's SFT weights folder")
    parser.add_argument("--judge-base", type=Path, default=None,
                        help="the model the judge is fine-tuned from (default: --policy)")
    parser.add_argument("--judge-steps", type=int, default=150)
    parser.add_argument("--judge-lr", type=float, default=1e-3)
    parser.add_argument("--grpo-steps", type=int, default=4)
    parser.add_argument("--samples", type=int, default=3, help="judge answers per step (reward.prm.samples)")
    parser.add_argument("--step-coef", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grpo-set", action="append", default=[], metavar="KEY=VALUE",
                        help="more `swectl up --set` overrides of the GRPO run (e.g. train.sampling.max_staleness=1, "
                        "train.sampling.sample_mode='\"step\"', experiment.step_score_advantage=0.5)")
    parser.add_argument("--tag", default="", help="suffix of the GRPO run folder and of the results key")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    t0 = time.monotonic()
    data = work / "judge.jsonl"
    if not data.exists():
        swectl(["data", "judge", *map(str, args.judge_data), "--tasks", str(args.tasks), "--out", str(data)],
               "judge data")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    labels = {"good": sum(r["label"] > 0 for r in rows), "bad": sum(r["label"] < 0 for r in rows)}
    judge = up(work, "judge", {"train": {
        "algorithm": "sft", "model": str(args.judge_base or args.policy), "steps": args.judge_steps,
        "data": {"sft_data": [str(data)], "sft_batch_size": 8}, "seed": args.seed, "save_every": args.judge_steps,
        "optim": {"lr": args.judge_lr, "warmup_steps": 3, "schedule": "constant"}}})
    timings["judge_sft_s"] = time.monotonic() - t0

    extra: dict[str, object] = {}
    for item in args.grpo_set:  # values parse as TOML, as `swectl up --set` takes them
        if "=" not in item:
            parser.error(f"--grpo-set wants KEY=VALUE, got {item!r}")
        apply_override(extra, item)
    run_id = "grpo-prm" + (f"-{args.tag}" if args.tag else "")
    t0 = time.monotonic()
    grpo = up(work, run_id, recipes.merge(recipes.merge(first_run_episodes(), {
        "train": {"algorithm": "grpo", "model": str(args.policy), "steps": args.grpo_steps, "seed": args.seed,
                  "concurrency": 8, "save_every": 0, "data": {"tasks": str(args.tasks), "test_fraction": 0.0},
                  "optim": {"lr": 2e-4}, "sampling": {"tasks_per_step": 4, "n_samples": 4, "max_sampling_rounds": 1},
                  "loss": {"mask_truncated": True, "mask_format_errors": True}},
        "reward": {"prm": {"enabled": True, "model": str(judge), "samples": args.samples,
                           "step_coef": args.step_coef, "max_tokens": 16}}}), extra))
    timings["grpo_prm_s"] = time.monotonic() - t0

    result = {"settings": json.loads(json.dumps(vars(args), default=str)),  # Paths as strings
              "judge_data": {"rows": len(rows), **labels}, "judge_weights": str(judge), "grpo_weights": str(grpo),
              "judge": agreement(work / run_id), "curve": prm_metrics(work / run_id),
              "timings_s": {k: round(v, 1) for k, v in timings.items()}, "meta": host_meta()}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    report = json.loads(args.results.read_text()) if args.results.exists() else {}
    report.setdefault("suite", "prm")
    report.setdefault("runs", {})[f"{work.name}:{run_id}"] = result  # one file, one entry per run
    report["latest"] = f"{work.name}:{run_id}"
    args.results.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(result["judge"], indent=1))
    say(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
