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
          "mempo_tokens_per_task", "full_mode_tokens_per_task", "minutes")  # fmt: skip


def _run(out: Path) -> tuple[dict, str]:
    env = {**os.environ, "MEMPO_CACHE": str(CACHE)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "learning_curve.py"), "--smoke", "--lr-decay", "--out", str(out)],
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
    assert "--lr-decay-steps 1 " in log and summary["lr_decay"]
    assert set(summary["goals"]) == {"em_mempo_over_sft_by_0.10", "p_mem_mempo_over_grpo",
        "tokens_memory_below_full_sft", "tokens_memory_below_full_mempo", "minutes_at_most_30"}  # fmt: skip
    assert all(v is None or isinstance(v, bool) for v in summary["goals"].values())

    again, log = _run(tmp_path)  # every phase done: nothing runs again
    assert again["per_seed"] == summary["per_seed"]
    assert "mempo_cli" not in log
