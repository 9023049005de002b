"""PNG plots of a run's metrics.jsonl (one JSON object per training step)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (file name, title, [(metric, label), ...])
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("reward.png", "Outcome reward and exact match", [("reward_mean", "reward"), ("correct_rate", "EM"),
                                                     ("format_rate", "format ok")]),
    ("memory.png", "Memory reward R_M = P_mem - P_full", [("mem_reward_mean", "R_M"), ("p_mem_mean", "P_mem"),
                                                          ("p_full_mean", "P_full")]),
    ("tokens.png", "Tokens per task (one trajectory)", [("tokens_per_trajectory", "tokens")]),
    ("kl_clip.png", "KL to the reference and clip fraction", [("kl", "KL (k3)"), ("pg_clipfrac", "clip fraction"),
                                                              ("ppo_kl", "approx KL to old")]),
]

AVERAGE = 8  # steps in the reward's moving average (the plot and the live table)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Lines of metrics.jsonl; a line torn by a crash is skipped."""
    rows: list[dict[str, Any]] = []
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, row in enumerate(rows):
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            xs.append(float(row.get("step", i + 1)))
            ys.append(float(value))
    return xs, ys


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out = []
    for i in range(len(values)):
        recent = values[max(0, i + 1 - window) : i + 1]
        out.append(sum(recent) / len(recent))
    return out


def read_heldout(path: Path) -> dict[str, Any]:
    """``heldout.json`` of a run ({"start": {"em", ...}, "end": ..., "end_step"}), or {}."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _reward_extras(ax: Any, rows: Sequence[dict[str, Any]], heldout: dict[str, Any]) -> int:
    """The reward's moving average and the held-out EM before and after RL."""

    drawn = 0
    xs, ys = _series(rows, "reward_mean")
    if len(xs) > 1:
        ax.plot(xs, moving_average(ys, AVERAGE), linewidth=2.2, label=f"reward, mean of {AVERAGE} steps")
        drawn += 1
    points = [(0.0, heldout.get("start")), (float(heldout.get("end_step") or (xs[-1] if xs else 1)), heldout.get("end"))]
    points = [(x, p["em"]) for x, p in points if isinstance(p, dict) and isinstance(p.get("em"), (int, float))]
    if points:
        ax.plot(*zip(*points, strict=True), marker="*", markersize=12, linestyle=":", color="black",
                label="held-out EM (greedy)")
        drawn += 1
    return drawn


def plot_run(metrics_path: Path, out_dir: Path) -> list[Path]:
    """Write one PNG per panel with data; returns the files written. The reward panel also
    shows the reward's moving average and, when the run has a ``heldout.json`` next to its
    metrics, the held-out EM before (step 0) and after RL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    written: list[Path] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, title, curves in PANELS:
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
        drawn = 0
        for key, label in curves:
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
                drawn += 1
        if name == "reward.png" and drawn:
            drawn += _reward_extras(ax, rows, read_heldout(metrics_path.parent / "heldout.json"))
        if drawn:
            ax.set_title(title)
            ax.set_xlabel("training step")
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=8)
            fig.tight_layout()
            fig.savefig(out_dir / name)
            written.append(out_dir / name)
        plt.close(fig)
    return written
