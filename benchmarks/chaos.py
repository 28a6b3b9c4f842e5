"""`just bench chaos`: a seeded chaos soak of `swectl up` (issue 62).

The first run's GRPO phase (the recipe benchmarks/recipes/chaos.toml: asynchronous GRPO, the CPU engine, namespace
sandboxes, torchrun ranks) runs from ``--weights`` (an SFT checkpoint's weights folder; default: a fresh tiny model)
while faults from a seeded schedule hit it, one at a time, ``--gap`` seconds apart on average
(swectl/testing/chaos.py: engine server killed, its supervisor killed, engine SIGSTOPped for 30 s, trainer rank
killed, nsbox daemon killed, a sandbox killed, the run's disk filled to its last 1% for 30 s, the controller killed
and then `swectl up --resume`).

For each fault: what the user saw (the first warning line after it), whether the run went on by itself (for the
controller's death: after `--resume`), how long until the next step, and at the end: steps redone (the records a
restart or resume truncated), steps skipped, episodes aborted (never scored), infrastructure failures scored (goal
0) and what the run left behind (processes, sandboxes, records, mounts, shared memory, ports, containers: goal 0).

The run folder lives on a small ext4 file system of its own (``--disk-mib``, loop-mounted; root), so filling it
hurts nothing else on the machine. Writes ``benchmarks/results/chaos.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import recipe_run

from swectl.actors.rollout import EpisodeResult
from swectl.config import toml_value
from swectl.testing import chaos
from swectl.testing import nodes as testnodes

RESULTS = Path(__file__).resolve().parent / "results" / "chaos.json"
SWECTL = [sys.executable, "-m", "swectl.cli.main"]
SAW = re.compile(r"warning|restart|lost|error|failed|resum", re.IGNORECASE)


def say(message: str) -> None:
    print(f"chaos: {message}", file=sys.stderr, flush=True)


class Steps:
    """The run's steps.jsonl, watched: the last step, and steps redone (the records a restart or a resume cut)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "steps.jsonl"
        self.high = 0
        self.redone = 0

    def last(self) -> int:
        try:
            lines = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            return self.high
        last = lines[-1]["step"] if lines else 0
        if last < self.high:
            self.redone += self.high - last
        self.high = last
        return last


def own_disk(work: Path, mib: int) -> Path | None:
    """A loop-mounted ext4 file system of ``mib`` MiB at work/disk (mounted again if it is there), or None."""
    mount = work / "disk"
    if not mib:
        return None
    mount.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mountpoint", "-q", str(mount)], check=False).returncode == 0:
        return mount
    image = work / "disk.img"
    if not image.exists():
        subprocess.run(["truncate", "-s", f"{mib}M", str(image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)  # no root reserve
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    return mount


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([*SWECTL, *argv], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def saw(log: Path, offset: int) -> str:
    """The first lines after ``offset`` that say something happened (warnings, restarts, resumes)."""
    text = log.read_bytes()[offset:].decode(errors="replace")
    hits = [line.strip() for line in text.splitlines() if SAW.search(line)]
    return " | ".join(hits[:2])[:400]


def wait_gone(controller: int, timeout_s: float = 60.0) -> list[str]:
    """After the controller's death: wait for its programs to stop (their supervisors see stdin close)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [pid for pid, (ppid, state, cmd) in chaos.processes().items()
                if state != "Z" and any(p in cmd for p in chaos.SWECTL_PROGRAMS[:3]) and ppid in (1, controller)]
        if not left:
            return []
        time.sleep(0.5)
    return [str(p) for p in left]


def redone_from_log(text: str) -> int:
    """Steps trained twice: at each "resuming after step K", the steps already trained past K."""
    high = redone = 0
    for line in text.splitlines():
        if step := re.match(r"step (\d+)/\d+", line):
            high = max(high, int(step.group(1)))
        elif resumed := re.search(r"resuming after step (\d+)", line):
            redone += max(0, high - int(resumed.group(1)))
            high = int(resumed.group(1))
    return redone


def scored_infra(run_dir: Path) -> int:
    """Rewarded episodes whose episode was ABORTED or whose grading failed as infrastructure (goal 0)."""
    bad = 0
    for rewards in (run_dir / "episodes").glob("*/rewards.jsonl"):
        for line in rewards.read_text().splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            meta = rewards.parent / f"{row['instance_id']}__{row['sample']}" / "meta.json"
            if not meta.exists():
                continue
            result = msgspec.json.decode(meta.read_bytes(), type=EpisodeResult)
            bad += result.outcome == "ABORTED" or bool(result.grade is not None and result.grade.infra)
    return bad


def read_weights(args: argparse.Namespace, run_dir: Path, kept: Path) -> dict:
    """The soak's final weights read as the first run reads its GRPO weights (its eval-grpo phase's command, the
    recipe's settings and seed), the reading kept in ``kept``/eval-grpo; the gain from --sft-reading and the
    difference from each --clean reading, one standard error each (paired by episode: same tasks, samples, seed)."""
    from swectl.cli.phases import command_of, paired_noise_points, reading
    from swectl.train import recipe as recipes
    from swectl.train.checkpoint import latest_checkpoint

    found = latest_checkpoint(run_dir / "grpo")
    if found is None:
        raise SystemExit(f"chaos: {run_dir / 'grpo'} has no checkpoint to read")
    recipe = recipes.load("first-run", {"seed": args.seed})
    phase = next(p for p in recipe.file.phase if p.name == "eval-grpo")
    records = {"grpo": recipes.PhaseRecord(seconds=0.0, argv=[], weights=found[1].weights)}
    command = command_of(recipe, phase, run_dir, recipes.names_for(recipe, run_dir, records, phase), [])
    argv = list(command.argv)
    argv[argv.index("--out") + 1] = str(kept / "eval-grpo")
    say(f"reading the final weights: swectl {' '.join(argv)}")
    subprocess.run([*SWECTL, *argv], check=True, timeout=3600)
    mine = reading(kept / "eval-grpo")
    out: dict = {"resolved": mine.resolved, "episodes": mine.episodes, "aborted": mine.aborted,
                 "resolve_rate": mine.resolve_rate, "folder": mine.folder, "weights": found[1].weights}
    if args.sft_reading is not None:
        sft = reading(args.sft_reading)
        out["gain_points"] = round(100 * (mine.resolve_rate - sft.resolve_rate), 1)
        out["gain_se"] = paired_noise_points(sft, mine)
    for clean_dir in args.clean:
        clean = reading(clean_dir)
        out.setdefault("against_clean", []).append({
            "folder": str(clean_dir), "resolved": clean.resolved,
            "difference_points": round(100 * (mine.resolve_rate - clean.resolve_rate), 1),
            "se": paired_noise_points(clean, mine)})
    say(f"reading: {json.dumps(out)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="the schedule's seed (and the run's)")
    parser.add_argument("--faults", type=int, default=21)
    parser.add_argument("--kinds", default="", help="comma-separated fault kinds (default: every one that applies: "
                        "ssh_net_down needs --ssh-nodes, disk_full --disk-mib)")
    parser.add_argument("--ssh-nodes", type=int, default=0, metavar="N",
                        help="run the sandboxes on N SSH test nodes in network namespaces (swectl/testing/nodes.py; "
                             "root), the engine and trainer on this machine")
    parser.add_argument("--gap", type=float, default=20.0, help="mean seconds between a recovery and the next fault")
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps of the run")
    parser.add_argument("--weights", type=Path, default=None,
                        help="the policy to start from (an SFT run's weights folder; default: a fresh tiny model)")
    parser.add_argument("--work", type=Path, default=Path("runs/chaos"))
    parser.add_argument("--disk-mib", type=int, default=4096,
                        help="size of the run's own file system (0: none, and no disk_full faults)")
    parser.add_argument("--recover-timeout", type=float, default=420.0,
                        help="seconds a fault may take until the run's next step before it counts as not survived")
    parser.add_argument("--reading", action="store_true",
                        help="after the run, read its final weights as the first run's eval-grpo phase does (`swectl "
                             "eval`, the recipe's settings) and write the reading beside the summary; with --clean, "
                             "its difference from a clean run's reading, paired by episode")
    parser.add_argument("--clean", type=Path, action="append", default=[], metavar="EVAL_DIR",
                        help="a clean run's eval folder of the same seed and settings to compare the reading with "
                             "(e.g. a first run's eval-grpo; repeatable)")
    parser.add_argument("--sft-reading", type=Path, default=None, metavar="EVAL_DIR",
                        help="the reading of the weights the soak started from (the first run's eval-sft): the "
                             "gain is measured from it")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k] or [k for k in chaos.FAULTS
                                                         if k != "ssh_net_down" or args.ssh_nodes]
    if unknown := [k for k in kinds if k not in chaos.FAULTS]:
        parser.error(f"--kinds: unknown {', '.join(unknown)} (choose from {', '.join(chaos.FAULTS)})")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    disk = own_disk(work, args.disk_mib)
    if disk is None:
        kinds = [k for k in kinds if k != "disk_full"]
    with contextlib.ExitStack() as stack:
        nodes = stack.enter_context(testnodes.test_nodes(args.ssh_nodes, prefix="chs", base_index=230)) \
            if args.ssh_nodes else None
        return soak(args, kinds, work, disk, nodes)


def soak(args: argparse.Namespace, kinds: list[str], work: Path, disk: Path | None,
         nodes: testnodes.TestNodes | None) -> int:
    out_dir = disk or work
    run_id = f"chaos-seed{args.seed}"
    run_dir = out_dir / run_id
    if run_dir.exists():
        raise SystemExit(f"chaos: {run_dir} exists: pick another --work or --seed, or delete it")
    lines = []  # what chaos.toml's vars do not say, in a recipe file extending it
    if args.weights:  # GRPO from those weights: no model phase
        lines += ['drop = ["model"]', "", "[[phase]]", 'name = "grpo"', "after = []",
                  f"config = {{ train = {{ model = {toml_value(str(args.weights.resolve()))} }} }}"]
    if nodes is not None:  # the sandboxes on the test nodes; engine and trainer on the local node
        cluster = work / f"{run_id}.toml"
        names = json.dumps([n.name for n in nodes.nodes])
        cluster.write_text(nodes.cluster_toml(local=True, extra_node_fields="connect_timeout_s = 5\n"
                                              "keepalive_interval_s = 2") +
                           f'\n[env_pool]\nnodes = {names}\n\n[engine]\nnodes = ["local"]\n\n'
                           '[trainer]\nnodes = ["local"]\n')
        lines.insert(0, f"base = {toml_value(str(cluster))}")
    recipe = recipe_run.derived(work / f"{run_id}.recipe.toml", "chaos", lines)
    up = recipe_run.up_argv(recipe, run_dir, recipe_run.var_sets({"seed": args.seed, "grpo_steps": args.steps}))
    train_dir = run_dir / "grpo"
    log = work / f"{run_id}.log"
    rng = random.Random(args.seed)
    order = [kinds[i % len(kinds)] for i in range(args.faults)]
    rng.shuffle(order)
    say(f"{len(order)} faults of {len(set(order))} kinds, run {run_dir}, log {log}")
    before = chaos.footprint()
    started = time.monotonic()
    proc = start(up, log)
    run = chaos.Run(controller=proc.pid, run_dir=train_dir, disk=disk, rng=rng,
                    nodes=list(nodes.nodes) if nodes is not None else [])
    steps = Steps(train_dir)
    table: list[dict] = []
    resumes = 0
    while steps.last() < 1 and proc.poll() is None:  # faults start once the run trains
        time.sleep(1)
    for n, kind in enumerate(order, start=1):
        pause = rng.uniform(0.5, 1.5) * args.gap
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline and proc.poll() is None:
            steps.last()
            time.sleep(0.5)
        if proc.poll() is not None:
            say(f"the run ended (exit {proc.returncode}) before fault {n}")
            break
        at_step, offset, t0 = steps.last(), log.stat().st_size, time.monotonic()
        what = ""
        for _ in range(60):  # a target may be missing for a moment (no sandbox between episodes)
            try:
                what = chaos.FAULTS[kind](run)
                break
            except chaos.NoTarget as missing:
                what = f"no target: {missing}"
                time.sleep(1)
        say(f"fault {n}/{len(order)} at step {at_step}: {kind}: {what}")
        by_itself = True
        if kind == "controller_kill" and not what.startswith("no target"):
            proc.wait(timeout=60)
            left = wait_gone(run.controller)
            proc = start(["up", "--resume", str(run_dir)], log)
            run.controller, by_itself = proc.pid, False
            resumes += 1
            if left:
                what += f"; still running 60 s after: {', '.join(left)}"
        recovered = False
        while time.monotonic() - t0 < args.recover_timeout:
            if steps.last() > at_step:
                recovered = True
                break
            if proc.poll() is not None:
                break
            time.sleep(0.5)
        exit_code = proc.poll()
        table.append({"n": n, "kind": kind, "what": what, "at_step": at_step, "recovered": recovered,
                      "went_on_by_itself": by_itself and recovered and exit_code is None,
                      "next_step_s": round(time.monotonic() - t0, 1) if recovered else None,
                      "saw": saw(log, offset), "run_exit": exit_code})
        say(f"  -> {'next step after ' + str(table[-1]['next_step_s']) + ' s' if recovered else 'NOT recovered'}; "
            f"saw: {table[-1]['saw'][:200]}")
        if exit_code not in (None, 0):  # the fault ended the run: resume it, so the soak goes on
            say(f"  the run failed (exit {exit_code}); resuming it")
            proc = start(["up", "--resume", str(run_dir)], log)
            run.controller = proc.pid
            resumes += 1
    run.wait_background()
    while proc.poll() is None:
        steps.last()
        time.sleep(1)
    exit_code = proc.returncode
    steps.last()
    time.sleep(15)  # what the run's programs stop on their way out
    after = chaos.footprint()
    left = chaos.leaks(before, after)
    text = log.read_text(errors="replace")
    state_file = train_dir / "checkpoints" / (train_dir / "checkpoints" / "latest").read_text().strip() / \
        "controller.json" if (train_dir / "checkpoints" / "latest").exists() else None
    state = json.loads(state_file.read_text()) if state_file else {}
    recorded = [json.loads(line)["step"] for line in (train_dir / "steps.jsonl").read_text().splitlines()
                if line.strip()] if (train_dir / "steps.jsonl").exists() else []
    summary = {
        "faults": len(table), "kinds": sorted({r["kind"] for r in table}),
        "run_finished": exit_code == 0 and recorded == list(range(1, args.steps + 1)),
        "exit_code": exit_code, "resumes": resumes,
        "faults_survived_by_itself": sum(r["went_on_by_itself"] for r in table),
        "faults_survived_by_resume": sum(r["recovered"] and not r["went_on_by_itself"] for r in table),
        "faults_not_survived": sum(not r["recovered"] for r in table),
        "steps_redone": max(steps.redone, redone_from_log(text)),
        "steps_skipped": sorted(set(range(1, args.steps + 1)) - set(recorded)),  # goal: none
        # steps GRPO trained nothing on because every group had equal rewards (not a fault's doing)
        "steps_without_signal": list(state.get("skipped_steps", [])),
        "episodes_aborted": len(re.findall(r"episode \S+ aborted", text)),
        "infra_scored": scored_infra(train_dir), "leaks": left, "minutes": round((time.monotonic() - started) / 60, 1),
    }
    say(json.dumps(summary))
    kept = work / run_id  # the run folder off the soak's own file system
    if disk is not None and not kept.exists():
        shutil.copytree(run_dir, kept, ignore=shutil.ignore_patterns("weights", "checkpoints", "*.safetensors"))
    result = {"seed": args.seed, "date": time.strftime("%Y-%m-%d"), "settings": {
        k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
        for k, v in vars(args).items()}, "summary": summary,
        "faults": table, "run_dir": str(kept if disk is not None else run_dir), "log": str(log)}
    if args.reading and summary["run_finished"]:
        result["reading"] = read_weights(args, run_dir, kept)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    for row in table:
        print(f"{row['n']:>3} {row['kind']:<24} step {row['at_step']:>3}  "
              f"{'by itself' if row['went_on_by_itself'] else 'resumed' if row['recovered'] else 'NOT SURVIVED':<12} "
              f"next step {row['next_step_s']} s | {row['saw'][:150]}")
    return 0 if summary["run_finished"] and not left and not summary["infra_scored"] else 1


if __name__ == "__main__":
    sys.exit(main())
