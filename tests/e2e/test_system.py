"""End to end: 2 training steps with 2 rollout replicas, every service a real process.

redis-server, retrieval, scorer, 2 CPU engines + 2 rollout workers and the learner run as
``mempo up`` starts them (tests/e2e/system.py), on the tiny model. The tests read the
outcome from outside: the learner's /v1/status, every engine's /model_info, the Redis
streams, the checkpoints and metrics.jsonl on disk.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from mempo.procs import free_port
from mempo_cli.launcher.plots import PANELS, plot_run
from tests.e2e.system import BATCH_GROUPS, System

pytestmark = pytest.mark.e2e

STEPS = 2


@pytest.fixture(scope="module")
def finished(trained_system: System) -> System:
    """The system once the learner has taken its steps and every worker is idle again
    (the tasks admitted after the last step have become groups in the group stream)."""
    s = trained_system
    s.wait("the learner to finish", lambda: s.status()["state"] == "finished", timeout_s=120)
    s.wait("the task stream to drain", lambda: not s.stream_group_ids(s.keys.tasks), timeout_s=60)
    return s


def test_every_engine_and_the_scorer_end_at_the_learners_version(finished: System) -> None:
    s = finished
    status = s.status()
    assert (status["step"], status["version"]) == (STEPS, STEPS)
    assert status["error"] is None
    # The learner pushed the last version to the scorer and, through every replica's
    # worker (never the engine itself), to every engine ...
    publish = status["last_publish"]
    assert publish["version"] == STEPS and publish["stale"] == {}
    assert sorted(publish["updated"]) == sorted([s.ends.scorer, *s.ends.workers])
    # ... and every one of them serves it now (each worker syncs its engine too).
    s.wait(
        "every engine and the scorer at the learner's version",
        lambda: set(s.weight_versions().values()) == {str(STEPS)},
        timeout_s=30,
    )
    for i in range(len(s.ends.workers)):
        worker = s.worker_status(i)
        assert worker["engine_weight_version"] == str(STEPS), worker
        assert worker["policy_version"] == STEPS, worker


def test_every_admitted_task_is_trained_once_or_still_queued(finished: System) -> None:
    s = finished
    ledger = s.ledger()
    assert not ledger.problems(STEPS, BATCH_GROUPS), ledger.problems(STEPS, BATCH_GROUPS)
    # Fully on-policy (max_staleness 0): one batch admitted at start and one after each
    # step, so tasks 0-1 trained in step 1, 2-3 in step 2, and 4-5 wait as groups.
    admitted = ledger.admitted
    assert len(admitted) == (STEPS + 1) * BATCH_GROUPS
    checkpoints = s.checkpoints()
    assert sorted(checkpoints) == [1, 2]
    assert set(checkpoints[1]["trained_group_ids"]) == set(admitted[:2])
    assert set(checkpoints[2]["trained_group_ids"]) == set(admitted[:4])
    assert ledger.in_flight == set(admitted[4:])
    assert set(s.stream_group_ids(s.keys.groups).values()) == set(admitted[4:])
    assert ledger.dead == {} and s.dead_letters() == []
    assert (ledger.dropped_stale, ledger.dropped_duplicate) == (0, 0)
    assert s.pending_groups() == [] and s.pending_tasks() == []  # nothing left claimed
    # Each task ran exactly once, on one of the two workers, and none failed.
    workers = [s.worker_status(i) for i in range(len(s.ends.workers))]
    assert sum(w["tasks_done"] for w in workers) == len(admitted), workers
    assert sum(w["tasks_failed"] for w in workers) == 0, workers
    status = s.status()
    assert (status["admitted"], status["consumed"], status["in_flight"]) == (6, 4, 2)


def test_metrics_has_one_line_per_step_and_plots_are_written(finished: System) -> None:
    s = finished
    rows = s.metrics()
    assert [(r["step"], r["version"]) for r in rows] == [(1, 1), (2, 2)]
    assert sum(r["groups"] for r in rows) == STEPS * BATCH_GROUPS
    for row in rows:
        for key in ("reward_mean", "correct_rate", "format_rate", "loss", "kl", "pg_clipfrac",
                    "tokens_per_trajectory", "step_s", "publish_s", "staleness_mean"):  # fmt: skip
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row)
        for key in ("p_mem_mean", "p_full_mean", "mem_reward_mean"):
            assert key in row, key  # null when no round wrote a memory
        assert 0.0 <= row["reward_mean"] <= 1.0 and 0.0 <= row["format_rate"] <= 1.0
        assert row["staleness_max"] == 0.0  # fully on-policy
        assert row["engines_updated"] == 3.0 and row["engines_stale"] == 0.0
    assert s.status()["last_metrics"]["step"] == STEPS

    written = plot_run(s.run_dir / "metrics.jsonl", s.run_dir)
    names = {p.name for p in written}
    assert {"reward.png", "tokens.png", "kl_clip.png"} <= names <= {name for name, _, _ in PANELS}
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000, path


def test_mempo_eval_uses_a_running_engine(finished: System, tiny_model_dir: Path, tmp_path: Path) -> None:
    """`mempo eval --engine-url` (how a GPU run evaluates on SGLang): no engine of its own."""

    def mempo_eval(engine_url: str, out: Path) -> subprocess.CompletedProcess[str]:
        argv = ["eval", "--model", str(tiny_model_dir), "--engine-url", engine_url, "--ks", "1",
                "--tasks", "2", "--modes", "memory", "--score", "--transcripts", "1", "--out", str(out)]  # fmt: skip
        return subprocess.run([sys.executable, "-m", "mempo_cli", *argv], capture_output=True, text=True, timeout=300)

    done = mempo_eval(finished.ends.engines[0], tmp_path / "eval")
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads((tmp_path / "eval" / "eval.json").read_text())["results"]["memory"]["1"]
    assert figures["tasks"] == 2 and figures["tokens_per_task"] > 0 and 0 <= figures["em"] <= 1
    assert "p_mem" in figures or figures["format_rate"] < 1  # scored wherever a memory was written
    failures = json.loads((tmp_path / "eval" / "eval.json").read_text())["failures"]["memory"]["1"]
    assert sum(failures.values()) == 2 and failures["correct"] == round(2 * figures["em"])
    transcript = (tmp_path / "eval" / "transcripts-memory-k1.md").read_text()
    assert transcript.count("## episode ") == 1 and "round 1 (" in transcript
    assert sorted(p.name for p in (tmp_path / "eval" / "logs").iterdir()) == [
        "retrieval.log", "scorer.log", "worker.log"
    ]

    nobody = mempo_eval(f"http://127.0.0.1:{free_port()}", tmp_path / "nobody")
    assert nobody.returncode == 1 and "does not answer /model_info" in nobody.stderr
    assert "Traceback" not in nobody.stderr and not (tmp_path / "nobody" / "logs").exists()
