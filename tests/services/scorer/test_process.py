"""`mempo scorer serve` as a real process, called with the shared ScorerClient."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mempo.api.scorer import MemoryRound, MemoryTrajectory, ScoreItem
from mempo.clients.scorer import ScorerClient, ScorerError
from mempo.procs import free_port, wait_ready


@pytest.fixture
def scorer_url(tiny_model_dir: Path, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "MEMPO_SCORER_ADMIN_TOKEN": "t0ken-0123456789abcdef", "MEMPO_SCORER_MAX_WAIT_MS": "2"}
    args = [sys.executable, "-m", "mempo_cli", "scorer", "serve", "--port", str(port)]
    args += ["--model-path", str(tiny_model_dir), "--weights-root", str(tmp_path)]
    log = (tmp_path / "scorer.log").open("wb")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=90, proc=proc)
        yield url
    finally:
        proc.terminate()  # uvicorn shuts down gracefully, then re-raises SIGTERM
        code = proc.wait(timeout=30)
        log.close()
        text = (tmp_path / "scorer.log").read_text()
        assert code in (0, -15) and "Application shutdown complete" in text, text[-2000:]


async def test_serve_scores_over_http(scorer_url: str) -> None:
    client = ScorerClient(scorer_url, attempts=1)
    try:
        trajectory = MemoryTrajectory(
            questions=["Where was Bothi born?"],
            answers=[["Dostania"]],
            rounds=[
                MemoryRound(memory="Q1: ?", transcript="<mem>Q1: ?</mem>\n<search>Bothi</search>"),
                MemoryRound(memory="Q1: Dostania", transcript="<answer>Dostania</answer>"),
            ],
        )
        scores = await client.memory_scores([trajectory, trajectory])
        assert scores.weight_version == "0" and len(scores.results) == 2
        assert all(r.reward is not None for r in scores.results[0].rounds)
        items = await client.score([ScoreItem(context="Bothi was born in", answers=["Dostania"])])
        assert items.scores[0].num_tokens > 0
        response = await client.http.post(
            f"{scorer_url}/update_weights_from_disk",
            json={"model_path": "/", "weight_version": "1"},
        )
        assert response.status_code == 401
        with pytest.raises(ScorerError) as info:
            await client.score([ScoreItem(context="", answers=["x"])])
        assert info.value.status_code == 422
    finally:
        await client.aclose()
