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


def plot_run(metrics_path: Path, out_dir: Path) -> list[Path]:
    """Write one PNG per panel with data; returns the files written."""
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
