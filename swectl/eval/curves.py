"""Learning curves of a training run: ``swectl plot`` reads ``<run>/metrics.jsonl`` and draws one PNG per panel.

It lives in swectl/eval/ (the commands layer, beside the eval reports) because it looks at a run's results
after the fact, as the eval drivers do; it reads the file through the Metrics actor's reader
(``swectl.actors.metrics.read_metrics``, commands -> actors), so the format has one owner. swectl/train/ is the
controller that writes the file, and swectl/cli/plot.py keeps to the argparse half.

Drawing uses matplotlib's object API on the Agg canvas (no pyplot, no display, no global figure state).
Only the metrics a run has are drawn: a panel with none of its keys is left out, a subplot likewise.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swectl.actors.metrics import METRICS_FILE, read_metrics
from swectl.errors import ConfigError, TaskDataError

PLOTS_DIR = "plots"

_log = logging.getLogger(__name__)

Match = Callable[[str], bool]


def _keys(*names: str) -> Match:
    return lambda key: key in names


def _phase_time(key: str) -> bool:
    """Seconds per phase: ``rollout_s``, ``train_s``, ``sync_s``, ... (not rates, not eval/ or agent/ ones)."""
    return "/" not in key and key.endswith("_s") and not key.endswith("per_s")


def _eval_rate(key: str) -> bool:
    return key.startswith("eval/") and ("resolve" in key or "pass" in key)


@dataclass(frozen=True)
class Subplot:
    """One set of axes: its title, its y label and which metric keys it draws."""
    title: str
    ylabel: str
    match: Match


@dataclass(frozen=True)
class Panel:
    """One PNG: its file stem, its title and its subplots (stacked, sharing the step axis)."""
    name: str
    title: str
    subplots: tuple[Subplot, ...]


PANELS: tuple[Panel, ...] = (
    Panel("reward", "reward and resolve rate", (
        Subplot("reward mean, resolve rate, pass@k", "per episode", _keys("reward_mean", "resolve_rate", "pass_at_k")),
    )),
    Panel("loss", "loss", (Subplot("loss", "per token", _keys("loss")),)),
    Panel("entropy_kl", "entropy and KL", (
        Subplot("entropy", "nats per token", _keys("entropy")),
        Subplot("KL to the reference", "per token", _keys("kl_mean", "kl")),
    )),
    Panel("grad_lr", "gradient norm and learning rate", (
        Subplot("gradient norm (before clipping)", "norm", _keys("grad_norm")),
        Subplot("learning rate", "lr", _keys("lr")),
    )),
    Panel("clipping", "clipping and importance ratios", (
        Subplot("clipped token fraction", "fraction", _keys("clip_frac_low", "clip_frac_high", "tis_clip_frac")),
        Subplot("importance ratio", "ratio", _keys("ratio_mean", "ratio_max", "tis_mean", "tis_max")),
    )),
    Panel("throughput", "throughput and time per phase", (
        Subplot("training tokens per second", "tokens/s", _keys("tokens_per_s", "train_tokens_per_s")),
        Subplot("time per phase", "seconds", _phase_time),
    )),
    Panel("eval", "held-out evaluation", (Subplot("eval resolve rate", "fraction", _eval_rate),)),
)

Series = dict[str, tuple[list[int], list[float]]]


def _series(records: list[dict[str, Any]]) -> Series:
    """Per key, (steps, values) sorted by step; the last value logged for a step wins. A null (a non-finite
    value, as Metrics writes it) is a NaN, which breaks the line there; strings and bools are not drawn, nor a key
    with no finite value."""
    by_key: dict[str, dict[int, float]] = {}
    for record in records:
        step = record["step"]
        for key, value in record.items():
            if key in ("step", "time"):
                continue
            if value is None:
                by_key.setdefault(key, {})[step] = math.nan
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                by_key.setdefault(key, {})[step] = float(value)
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in by_key.items()
            if any(math.isfinite(v) for v in points.values())}


def load_series(run_dir: Path) -> Series:
    """The metrics of ``run_dir/metrics.jsonl`` as series; malformed lines are logged (file:line) and skipped.

    ConfigError: no such run folder or no metrics.jsonl in it. TaskDataError: nothing in it to draw."""
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR {run_dir}: no such folder (a training run's output folder, with {METRICS_FILE})")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ConfigError(f"RUN_DIR {run_dir}: no {METRICS_FILE} there (is it a training run's output folder?)")
    try:
        records, problems = read_metrics(path)
    except OSError as exc:
        raise TaskDataError(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    for problem in problems:
        _log.warning("%s (line skipped)", problem)
    if not records:
        why = f"all {len(problems)} line(s) malformed" if problems else "empty"
        raise TaskDataError(f"{path}: no metrics to plot ({why})")
    return _series(records)


def _draw(panel: Panel, series: Series, path: Path) -> bool:
    """Draw ``panel`` into ``path``; False when the run has none of its keys (nothing written)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    filled = [(sub, sorted(k for k in series if sub.match(k))) for sub in panel.subplots]
    filled = [(sub, keys) for sub, keys in filled if keys]
    if not filled:
        return False
    figure = Figure(figsize=(8, 3.2 * len(filled)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(filled), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (sub, keys) in zip(axes, filled, strict=True):
        for key in keys:
            steps, values = series[key]
            ax.plot(steps, values, marker="." if len(steps) < 60 else None, label=key)
        ax.set_title(sub.title if len(filled) > 1 else panel.title)
        ax.set_ylabel(sub.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("step")
    if len(filled) > 1:
        figure.suptitle(panel.title)
    figure.savefig(path, format="png", dpi=100)
    return True


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Draw the learning curves of ``run_dir`` (PNG per panel) into ``out_dir`` (default ``run_dir/plots``);
    the files written, in panel order. Errors as ``load_series``, and TaskDataError when no panel has data."""
    run_dir = Path(run_dir)
    series = load_series(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / PLOTS_DIR
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create it: {exc.strerror or exc}") from exc
    written = [out / f"{panel.name}.png" for panel in PANELS if _draw(panel, series, out / f"{panel.name}.png")]
    if not written:
        raise TaskDataError(f"{run_dir / METRICS_FILE}: none of the plotted metrics is there (it has: "
                            f"{', '.join(sorted(series)) or 'no numbers'})")
    return written
