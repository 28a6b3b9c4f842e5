"""`swectl plot`: a training run's learning curves as PNG files (the drawing is swectl/eval/curves.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from swectl import logs
from swectl.eval.curves import PLOTS_DIR, plot_run

_DESCRIPTION = f"""\
Read RUN_DIR/metrics.jsonl (what a training run logs every step) and draw its learning curves, one PNG per
panel: reward mean and resolve rate; loss; entropy and KL; gradient norm and learning rate; clip fractions and
importance ratios; tokens/s and time per phase; held-out eval resolve rate. Only the metrics the run has are
drawn; malformed lines are reported (file:line) and skipped. Works on a run that is still going.

The PNGs go to RUN_DIR/{PLOTS_DIR}/ unless --out names another folder; their paths are printed."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    plot = sub.add_parser("plot", help="draw a training run's learning curves (PNG) from its metrics.jsonl",
                          description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    plot.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a training run's output folder")
    plot.add_argument("--out", type=Path, default=None, metavar="DIR",
                      help=f"folder for the PNG files (default RUN_DIR/{PLOTS_DIR})")


def run(args: argparse.Namespace) -> int:
    for path in plot_run(args.run_dir, args.out):
        print(path, file=logs.out())
    return 0
