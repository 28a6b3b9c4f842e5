"""`just bench harbor`: Harbor's trial time on the same task folders, in its own podman environment and in swectl's
sandboxes (issue 60 part 3).

The tasks: `swectl tasks export --harbor` of two bundled SWE tasks and one bundled terminal task (the folders Harbor
runs unmodified). Harbor 0.25.0 (.venv-harbor) runs its oracle agent on them, one trial at a time (``-n 1``), in
rounds that alternate the two environments so the machine's drift hits both:

- **podman**: Harbor's own podman environment (podman-compose 1.6.0; the compose overlay gives the container an init,
  without which every stop waits out podman's 10 s, and no network; ``--no-delete``, without which podman-compose
  removes the localhost images the tasks start FROM);
- **swectl**: ``-e swectl.serve.harbor_env:SwectlEnvironment`` against a ``swectl serve --tasks`` of the same folders
  (namespace sandboxes from the images swectl built for them; the build happens once, before the rounds).

A trial's time is its result.json's ``finished_at - started_at`` (environment start, agent, verifier, stop); the job's
wall time includes Harbor's CLI start. Every trial must score 1 (the oracle), else the run fails. Writes
``benchmarks/results/harbor.json``. Run: ``.venv/bin/python benchmarks/harbor.py [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import host_meta
from swectl.testing.harbor import REPO_ROOT, export_bundled, harbor_trials, removing_new_images, swectl_serving

RESULTS = REPO_ROOT / "benchmarks" / "results" / "harbor.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="swectl-bench-harbor-"))
    tasks = work / "tasks"
    export_bundled(tasks)
    seconds: dict[str, list[float]] = {"podman": [], "swectl": []}
    walls: dict[str, list[float]] = {"podman": [], "swectl": []}
    with removing_new_images(), swectl_serving(tasks, work / "serve") as url:
        for r in range(args.rounds):
            for env in ("podman", "swectl") if r % 2 == 0 else ("swectl", "podman"):
                started = time.monotonic()
                trials, run = harbor_trials(tasks, "oracle", work / f"jobs-{env}", home=work, environment=env,
                                            serve_url=url, n=1)
                walls[env].append(time.monotonic() - started)
                bad = [t for t in trials if t.reward != 1.0 or t.exception]
                if run.returncode != 0 or len(trials) != 3 or bad:
                    print(run.stdout[-3000:], run.stderr[-3000:], bad, file=sys.stderr)
                    return 1
                seconds[env] += [t.seconds for t in trials]
                print(f"round {r + 1} {env}: " + ", ".join(f"{t.task[:24]} {t.seconds:.2f}s" for t in trials))
    summary = {env: {"trials": len(v), "trial_mean_s": round(statistics.mean(v), 3),
                     "trial_p50_s": round(statistics.median(v), 3), "trial_max_s": round(max(v), 3),
                     "job_wall_mean_s": round(statistics.mean(walls[env]), 2)} for env, v in seconds.items()}
    ratio = summary["podman"]["trial_mean_s"] / summary["swectl"]["trial_mean_s"]
    result = {"benchmark": "harbor", **host_meta(), "rounds": args.rounds,
              "tasks": sorted(p.name for p in tasks.iterdir()), "agent": "oracle", "harbor": "0.25.0",
              "environments": summary, "trial_speedup_swectl_vs_podman": round(ratio, 2),
              "notes": ("trial = result.json finished_at - started_at, one trial at a time; podman = Harbor's podman "
                        "environment with an init and no network; swectl = SwectlEnvironment over swectl serve "
                        "(namespace sandboxes); the job wall time includes Harbor's CLI start (about 9 s)")}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"trial time: podman / swectl = {ratio:.2f}x; wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
