"""scripts/gpu-check on a machine without CUDA: every GPU part is skipped, named, and the
exit status is 0 (on a GPU machine the same command runs them: docs/operations.md)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.conftest import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the parts would run")
def test_gpu_check_skips_every_part_without_cuda(tmp_path: object) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([str(REPO / "scripts" / "gpu-check")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report == json.loads((tmp_path / "gpu-check.json").read_text())  # type: ignore[operator]
    parts = ("scorer_bf16", "learner_cuda", "fsdp2_one_gpu", "broadcast_nccl", "engine_cuda")
    assert all(report[p]["status"] == "skipped" and report[p]["why"] for p in parts), report
    assert report["failed"] == [] and report["devices"] == []
