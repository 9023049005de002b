"""``mempo runs compare``: runs side by side, the plot a user makes after every sweep.

One PNG with a panel per figure (reward and its moving average, held-out EM before and
after RL, P_mem and P_full, tokens per task, KL), one colour per run, and a table of
each run's final figures (printed, and as JSON beside the PNG). ``draw_runs`` takes the
runs already read, so a benchmark can draw its own runs (or their means) the same way.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mempo_cli.launcher.plots import AVERAGE, _series, moving_average, read_heldout, read_metrics

HELDOUT_TITLE = "held-out EM before and after RL (greedy)"
# (title, [(metric, line style)]); the reward panel also gets its moving average.
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    (f"reward (thin: per step, thick: mean of {AVERAGE})", [("reward_mean", "-")]),
    (HELDOUT_TITLE, []),
    ("P_mem (solid) and P_full (dashed)", [("p_mem_mean", "-"), ("p_full_mean", "--")]),
    ("tokens per task (one trajectory)", [("tokens_per_trajectory", "-")]),
    ("KL to the reference policy", [("kl", "-")]),
]


def load_runs(runs: Sequence[Path], labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """label -> {"rows": metrics lines with a step, "heldout": heldout.json or {}, "path"}.
    ValueError names a run without metrics.jsonl or without a step, an empty label, or a
    label given twice."""
    if not runs:
        raise ValueError("give at least one run folder")
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    if not all(labels):
        raise ValueError(f"every run needs a non-empty label (got {', '.join(map(repr, labels))})")
    twice = sorted({label for label in labels if labels.count(label) > 1})
    if twice:
        raise ValueError(f"two runs have the same label {', '.join(twice)} (give --labels)")
    loaded = {}
    for run, label in zip(runs, labels, strict=True):
        metrics = run / "metrics.jsonl"
        if not metrics.is_file():
            raise ValueError(f"{run}: no metrics.jsonl (give run folders, e.g. runs/<name>)")
        rows = [r for r in read_metrics(metrics) if isinstance(r.get("step"), int)]
        if not rows:
            raise ValueError(f"{metrics} holds no step (has the run trained yet?)")
        loaded[label] = {"rows": rows, "heldout": read_heldout(run / "heldout.json"), "path": str(run)}
    return loaded


def final_figures(run: dict[str, Any]) -> dict[str, Any]:
    """A run's last figures: the reward and its moving average, EM (correct_rate) over the
    last quarter of the steps, held-out EM, P_mem, tokens per task, KL, wall time; None
    where the run lacks the figure."""
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
    """Draw ``out`` (a .png) and write the table beside it (``out`` with .json); returns
    {label: final figures}. Labels default to the run folders' names."""
    if out.suffix.lower() != ".png":
        raise ValueError(f"--out {out} must be a .png file (its table goes beside it as .json)")
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder: give a .png file")
    loaded = load_runs(runs, list(labels) if labels is not None else [r.resolve().name for r in runs])
    table = {label: final_figures(run) for label, run in loaded.items()}
    draw_runs(loaded, out)
    out.with_suffix(".json").write_text(json.dumps(table, indent=1))
    return table


def _heldout_points(run: dict[str, Any]) -> list[tuple[float, float]]:
    """(step, held-out EM) before RL (step 0) and after it (end_step), where known."""
    heldout, rows = run["heldout"], run["rows"]
    points = [(0, heldout.get("start")), (heldout.get("end_step") or rows[-1]["step"], heldout.get("end"))]
    return [(float(x), p["em"]) for x, p in points if isinstance(p, dict) and isinstance(p.get("em"), (int, float))]


def _draw_panel(ax: Any, title: str, curves: list[tuple[str, str]], loaded: dict[str, dict[str, Any]]) -> None:
    """One panel: each run's curves in its colour (a run lacking a metric has no line)."""
    for i, run in enumerate(loaded.values()):
        colour = f"C{i % 10}"
        if title == HELDOUT_TITLE:
            points = _heldout_points(run)
            if points:
                ax.plot(*zip(*points, strict=True), marker="*", markersize=11, linestyle=":", color=colour)
            continue
        for key, style in curves:
            xs, ys = _series(run["rows"], key)
            if key != "reward_mean":
                ax.plot(xs, ys, style, color=colour, linewidth=1.5)
                continue
            ax.plot(xs, ys, style, color=colour, linewidth=0.8, alpha=0.45)
            if len(ys) > 1:
                ax.plot(xs, moving_average(ys, AVERAGE), color=colour, linewidth=2.4)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)


def _legend(ax: Any, labels: Sequence[str], heldout: bool) -> None:
    """The runs' names in their colours, then what the line styles mean, in a spare panel."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=f"C{i % 10}", linewidth=2.4, label=label) for i, label in enumerate(labels)]
    handles += [
        Line2D([], [], color="grey", linewidth=0.8, alpha=0.6, label="reward per step"),
        Line2D([], [], color="grey", linewidth=2.4, label=f"reward, mean of {AVERAGE} steps"),
        Line2D([], [], color="grey", linestyle="--", label="P_full"),
    ]
    if heldout:
        handles.append(Line2D([], [], color="grey", linestyle=":", marker="*", markersize=10, label="held-out EM"))
    ax.axis("off")
    ax.legend(handles=handles, loc="center", fontsize=9, title="runs", frameon=False)


def draw_runs(loaded: dict[str, dict[str, Any]], out: Path) -> list[str]:
    """Draw the runs ({label: {"rows", "heldout"}}, as ``load_runs`` reads them) on one
    PNG, two rows of panels and a legend; the held-out panel only when some run has a
    held-out EM. Returns the titles of the panels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS if p[0] != HELDOUT_TITLE or any(_heldout_points(r) for r in loaded.values())]
    columns = 3
    rows = (len(panels) + 1 + columns - 1) // columns  # + 1: the legend's panel
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.6 * rows), dpi=110, squeeze=False)
    cells = list(axes.flat)
    for ax, (title, curves) in zip(cells, panels, strict=False):
        _draw_panel(ax, title, curves, loaded)
    lows, highs = zip(*(ax.get_xlim() for ax in cells[: len(panels)]), strict=True)
    for ax in cells[: len(panels)]:  # one step axis for every panel (the held-out one too)
        ax.set_xlim(min(lows), max(highs))
    _legend(cells[len(panels)], list(loaded), heldout=len(panels) == len(PANELS))
    for ax in cells[len(panels) + 1 :]:
        ax.axis("off")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return [title for title, _ in panels]


def _cell(name: str, value: Any) -> str:
    if value is None:
        return "-"
    if name == "wall_s":
        return f"{int(value) // 60}m{int(value) % 60:02d}s"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"
    return str(value)


def table_rows(table: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The printed table's rows: (figure, a cell per run); the held-out EM as start -> end."""
    names = list(next(iter(table.values())))
    out: list[tuple[str, list[str]]] = []
    for name in names:
        if name == "heldout_em_end":
            continue
        if name == "heldout_em_start":
            cells = [f"{_cell(name, f[name])} -> {_cell(name, f['heldout_em_end'])}"
                     if f[name] is not None or f["heldout_em_end"] is not None else "-" for f in table.values()]  # fmt: skip
            out.append(("heldout_em (start -> end)", cells))
            continue
        out.append(("wall time" if name == "wall_s" else name, [_cell(name, f[name]) for f in table.values()]))
    return out


def print_table(table: dict[str, dict[str, Any]]) -> None:
    """The runs' final figures as a rich table, a column per run."""
    from rich.console import Console
    from rich.table import Table

    shown = Table(title=f"{len(table)} run{'s' if len(table) > 1 else ''}: final figures")
    for column in ["", *table]:
        shown.add_column(column, justify="right")
    for name, cells in table_rows(table):
        shown.add_row(name, *cells)
    Console().print(shown)
