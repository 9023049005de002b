"""benchmarks/learning_curve.py --smoke: every phase runs through the real commands and
services (random-weight tiny model, 1 RL step), the JSON line has the issue's fields, and a
second run resumes: every phase is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CACHE, REPO

pytestmark = pytest.mark.e2e

FIELDS = ("sft_em", "mempo_em", "grpo_em", "sft_p_mem", "mempo_p_mem", "grpo_p_mem",
          "mempo_tokens_per_task", "full_mode_tokens_per_task", "minutes",
          "sft_em_k2", "grpo_em_k2", "mempo_em_k2", "sft_format_k2")  # fmt: skip


def _run(out: Path) -> tuple[dict, str]:
    env = {**os.environ, "MEMPO_CACHE": str(CACHE)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "learning_curve.py"), "--smoke", "--arms", "mempo,grpo", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]
    return json.loads(lines[0]), proc.stderr


def test_smoke_runs_every_phase_and_resumes(tmp_path: Path) -> None:
    summary, log = _run(tmp_path)
    assert all(field in summary for field in FIELDS)
    assert summary["seeds"] == [0] and summary["arms"] == ["mempo", "grpo"]
    row = summary["per_seed"][0]
    assert 0.0 <= row["sft_em"] <= 1.0 and row["mempo_tokens_per_task"] > 0 and row["minutes"] > 0
    assert {"mempo_em", "grpo_em"} <= summary["spread"].keys()
    seed = tmp_path / "seed-0"
    for phase in ("sft", "eval-sft", "mempo-done", "eval-mempo", "grpo-done", "eval-grpo"):
        assert (seed / phase / "done.json").exists(), phase
    assert (seed / "mempo" / "metrics.jsonl").exists() and (tmp_path / "curves.png").stat().st_size > 0
    assert "mempo_cli up " in log  # the RL phase ran through `mempo up`
    assert "--lr-decay-steps 1 " in log and summary["lr_decay"]  # the recipe's defaults
    assert "--questions 1,2 --reward fraction " in log and "--copy-weight " in log
    for name in ("sft", "mempo", "grpo"):  # peak context at k = 2, both modes; failure kinds
        assert summary[f"{name}_peak_tokens_k2"] > 0 and summary[f"{name}_full_peak_tokens_k2"] > 0
        assert summary[f"{name}_full_history_peak_tokens_k2"] > 0
        assert sum(row[f"{name}_failures_k2"].values()) == 1
    assert set(summary["goals"]) == {"sft_k2_em_at_least_0.25", "sft_k2_format_at_least_0.90",
        "sft_k1_em_at_least_0.30", "k2_em_mempo_over_sft_by_0.10", "k2_em_grpo_over_sft_by_0.10",
        "k1_em_mempo_at_least_0.45", "k2_tokens_memory_below_full_history_mempo",
        "k2_peak_memory_at_most_0.6_full_history_mempo", "minutes_at_most_45"}  # fmt: skip
    assert all(v is None or isinstance(v, bool) for v in summary["goals"].values())

    again, log = _run(tmp_path)  # every phase done: nothing runs again
    assert again["per_seed"] == summary["per_seed"]
    assert "mempo_cli" not in log
