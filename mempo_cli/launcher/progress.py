"""Live progress of ``mempo up``: a rich table on a terminal, one line per step elsewhere."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mempo_cli.launcher.plots import AVERAGE, moving_average

# (label, metric key in the learner's last_metrics, format)
COLUMNS: list[tuple[str, str, str]] = [
    ("reward", "reward_mean", "{:.3f}"),
    (f"reward avg{AVERAGE}", "reward_avg", "{:.3f}"),
    ("EM", "correct_rate", "{:.3f}"),
    ("format", "format_rate", "{:.2f}"),
    ("R_M", "mem_reward_mean", "{:+.4f}"),
    ("P_mem", "p_mem_mean", "{:.4f}"),
    ("P_full", "p_full_mean", "{:.4f}"),
    ("tok/task", "tokens_per_trajectory", "{:.0f}"),
    ("KL", "kl", "{:.2e}"),
    ("clip", "pg_clipfrac", "{:.3f}"),
    ("step s", "step_s", "{:.1f}"),
]


@dataclass
class Snapshot:
    status: dict[str, Any]
    versions: dict[str, str]
    at: float


def _fmt(metrics: dict[str, Any], key: str, pattern: str) -> str:
    value = metrics.get(key)
    return pattern.format(value) if isinstance(value, (int, float)) else "-"


class Progress:
    def __init__(self, steps: int, enabled: bool = True, heading: str = "") -> None:
        self.steps = steps
        self.heading = heading  # a line above the table (the held-out score before RL)
        self.rewards: list[float] = []
        self.started = time.monotonic()
        self.console = Console(stderr=False, markup=False, highlight=False)  # "[mempo up]" is text
        self.live_mode = enabled and sys.stdout.isatty()
        self.enabled = enabled
        self.rows: list[list[str]] = []
        self.last_step = -1
        self.message = ""
        self.snap: Snapshot | None = None
        self.live: Live | None = None

    def __enter__(self) -> Progress:
        if self.heading and not self.live_mode and self.enabled:
            self.console.print(f"[mempo up] {self.heading}")
        if self.live_mode:
            self.live = Live(self._render(), console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.live is not None:
            self.live.update(self._render())
            self.live.__exit__(exc_type, exc, tb)

    def note(self, message: str) -> None:
        self.message = message
        if self.live is not None:
            self.live.update(self._render())
        elif self.enabled:
            self.console.print(f"[mempo up] {message}")

    def update(self, snap: Snapshot) -> None:
        self.snap = snap
        # A row is the journal's line of one step: its own step number, never the status's
        # (the trainer's step moves on before the step's metrics are written).
        metrics = snap.status.get("last_metrics") or {}
        step = metrics.get("step")
        if isinstance(step, int) and step > 0 and step != self.last_step:
            self.last_step = step
            if isinstance(metrics.get("reward_mean"), (int, float)):
                self.rewards.append(float(metrics["reward_mean"]))
            average = moving_average(self.rewards, AVERAGE)[-1] if self.rewards else None
            metrics = {**metrics, "reward_avg": average}
            row = [str(step), *(_fmt(metrics, key, f) for _, key, f in COLUMNS)]
            self.rows.append(row)
            if self.live is None and self.enabled:
                cells = " ".join(f"{label}={value}" for (label, _, _), value in zip(COLUMNS, row[1:], strict=True))
                self.console.print(f"[mempo up] step {step}/{self.steps} {cells} | {self._versions()}")
        if self.live is not None:
            self.live.update(self._render())

    def _versions(self) -> str:
        if self.snap is None:
            return ""
        return "versions " + " ".join(f"{k}=v{v}" for k, v in self.snap.versions.items())

    def _render(self) -> Group:
        table = Table(title=f"MemPO training: step {max(self.last_step, 0)}/{self.steps}", expand=False)
        table.add_column("step", justify="right")
        for label, _, _ in COLUMNS:
            table.add_column(label, justify="right")
        for row in self.rows[-15:]:
            table.add_row(*row)
        elapsed = time.monotonic() - self.started
        lines = [Text(f"elapsed {elapsed:.0f}s  {self.message}")]
        if self.heading:
            lines.insert(0, Text(self.heading))
        if self.snap is not None:
            s = self.snap.status
            lines.append(Text(
                f"learner {s.get('state')} v{s.get('version')}  tasks admitted {s.get('admitted')} "
                f"in flight {s.get('in_flight')}/{s.get('capacity')}  groups trained {s.get('consumed')} "
                f"dropped {s.get('dropped')}"
            ))
            lines.append(Text(self._versions()))
        return Group(table, *lines)
