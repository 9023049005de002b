"""Every benchmark runs in ``--smoke`` mode (seconds-scale sizes, one repetition) and prints
its JSON result: a change that breaks a benchmark fails here. Proves nothing about speed.
benchmarks/learning_curve.py has its own test (test_learning_curve.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import CACHE, REPO

pytestmark = pytest.mark.e2e

# benchmark: (JSON lines it prints in smoke mode, keys every line must have)
BENCHMARKS = {
    "agent_overhead": (1, ("ms_per_round", "concurrent_episodes", "errors")),
    "learner_vs_trl": (1, ("ours_tok_s", "trl_tok_s", "ratio")),
    "queue_throughput": (1, ("payload_mb_s", "raw_mb_s", "ratio")),
    "retrieval_qps": (1, ("bm25_qps", "http_qps", "baseline_qps", "http_concurrent_qps", "library_ratio")),
    "scorer_prefix_sharing": (1, ("rounds", "naive_s", "shared_s", "forward_s", "p_task_cost", "p_task_tokens")),  # one per T
    "token_efficiency": (2, ("questions", "memory_tokens", "full_tokens", "ratio")),  # one per k
    "weight_publish": (1, ("publish_s", "copy_s", "ratio", "engine_s", "scorer_s", "broadcast_ratio", "load_ratio")),
    "weights_io": (1, ("write_ratio", "load_ratio", "load_library_s", "load_library_mapped_s")),
}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_smoke(name: str) -> None:
    env = {**os.environ, "MEMPO_CACHE": str(CACHE)}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--smoke"],
        capture_output=True, text=True, env=env, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    count, keys = BENCHMARKS[name]
    assert len(lines) == count, proc.stdout[-2000:]
    results = [json.loads(line) for line in lines]  # stdout is the JSON lines and nothing else
    for result in results:
        assert isinstance(result, dict) and all(key in result for key in keys), result
    if name == "agent_overhead":  # every episode of the worker ran to a well-formed end
        assert results[0]["errors"] == 0, results[0]
