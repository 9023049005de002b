"""``mempo runs compare``: runs side by side, the plot a user makes after every sweep.

One PNG with a panel per figure (reward and its moving average, held-out EM before and
after RL, P_mem and P_full, tokens per task, KL), a line per run in one colour, and a
table of each run's final figures (printed, and as JSON beside the PNG).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mempo_cli.launcher.plots import AVERAGE, _series, moving_average, read_heldout, read_metrics

# (title, [(metric, line style)]): the reward panel also gets the moving average and held-out EM.
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("reward (thin) and its moving average", [("reward_mean", "-")]),
    ("held-out EM before and after RL", []),
    ("P_mem (solid) and P_full (dashed)", [("p_mem_mean", "-"), ("p_full_mean", "--")]),
    ("tokens per task", [("tokens_per_trajectory", "-")]),
    ("KL to the starting policy", [("kl", "-")]),
]


def load_runs(runs: Sequence[Path], labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """label -> {"rows": metrics lines, "heldout": heldout.json}; ValueError names a run
    that has no step, or a label given twice."""
    if len(set(labels)) != len(labels):
        raise ValueError(f"two runs have the same label: {', '.join(labels)} (give --labels)")
    loaded = {}
    for run, label in zip(runs, labels, strict=True):
        rows = [r for r in read_metrics(run / "metrics.jsonl") if isinstance(r.get("step"), int)]
        if not rows:
            raise ValueError(f"{run}: no metrics.jsonl with a step (give run folders)")
        loaded[label] = {"rows": rows, "heldout": read_heldout(run / "heldout.json"), "path": str(run)}
    return loaded


def final_figures(run: dict[str, Any]) -> dict[str, Any]:
    """A run's last figures: the reward and its moving average, EM over the last quarter of
    the steps, held-out EM, P_mem, tokens per task, KL, wall time."""
    rows, heldout = run["rows"], run["heldout"]
    last = rows[-1]
    _, rewards = _series(rows, "reward_mean")
    _, em = _series(rows[-max(1, len(rows) // 4) :], "correct_rate")
    times = [r["time"] for r in (rows[0], last) if isinstance(r.get("time"), (int, float))]
    return {
        "steps": last["step"],
        "reward": last.get("reward_mean"),
        f"reward_avg{AVERAGE}": moving_average(rewards, AVERAGE)[-1] if rewards else None,
        "em_last_quarter": statistics.fmean(em) if em else None,
        "heldout_em_start": (heldout.get("start") or {}).get("em"),
        "heldout_em_end": (heldout.get("end") or {}).get("em"),
        "p_mem": last.get("p_mem_mean"),
        "tokens_per_task": last.get("tokens_per_trajectory"),
        "kl": last.get("kl"),
        "wall_s": round(times[1] - times[0], 1) if len(times) == 2 else None,
    }


def compare_runs(runs: Sequence[Path], out: Path, labels: Sequence[str] | None = None) -> dict[str, Any]:
    """Draw ``out`` (PNG) and write ``out``.json; returns {label: final figures}."""
    loaded = load_runs(runs, list(labels) if labels else [r.resolve().name for r in runs])
    table = {label: final_figures(run) for label, run in loaded.items()}
    _draw(loaded, out)
    out.with_suffix(".json").write_text(json.dumps(table, indent=1))
    return table


def _draw(loaded: dict[str, dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.8), dpi=100)
    for i, (label, run) in enumerate(loaded.items()):
        colour = f"C{i % 10}"
        for ax, (title, curves) in zip(axes, PANELS, strict=True):
            for j, (key, style) in enumerate(curves):
                xs, ys = _series(run["rows"], key)
                thin = key == "reward_mean"
                ax.plot(xs, ys, style, color=colour, linewidth=0.8 if thin else 1.6, alpha=0.4 if thin else 1.0,
                        label=None if thin or j else label)  # fmt: skip
                if thin and len(ys) > 1:
                    ax.plot(xs, moving_average(ys, AVERAGE), color=colour, linewidth=2.2, label=label)
            ax.set_title(title, fontsize=10)
        _heldout(axes[1], run, colour, label)
    for ax in axes:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def _heldout(ax: Any, run: dict[str, Any], colour: str, label: str) -> None:
    heldout, rows = run["heldout"], run["rows"]
    points = [(0, heldout.get("start")), (heldout.get("end_step") or rows[-1]["step"], heldout.get("end"))]
    points = [(x, p["em"]) for x, p in points if isinstance(p, dict) and isinstance(p.get("em"), (int, float))]
    if points:
        ax.plot(*zip(*points, strict=True), marker="*", markersize=11, linestyle=":", color=colour, label=label)
