"""`mempo retrieval serve` as a real process with no configuration, called like Search-R1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mempo.procs import free_port, wait_ready
from mempo.world import World

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.e2e
def test_serves_search_r1_requests_with_zero_setup(world: World, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_RETRIEVAL_")}
    env.update(HF_HUB_OFFLINE="1", MEMPO_RETRIEVAL_PORT=str(port))
    log = (tmp_path / "retrieval.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mempo.cli", "retrieval", "serve"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=60, proc=proc)
        question = next(q for q in world.questions if len(q.relations) == 1)
        # What Search-R1's generation.py sends, with a plain synchronous client.
        payload = {"queries": [question.text, "born"], "topk": 3, "return_scores": True}
        result = httpx.post(f"{url}/retrieve", json=payload, timeout=10).json()["result"]
        assert [len(hits) for hits in result] == [3, 3]
        assert result[0][0]["document"]["contents"].startswith(f"{question.subject}\n")
        assert httpx.get(f"{url}/v1/info", timeout=10).json()["corpus_size"] == len(world.passages)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
        log.close()
    output = (tmp_path / "retrieval.log").read_text()
    # uvicorn shuts down gracefully, then re-raises SIGTERM: the exit status says so.
    assert code in (0, -signal.SIGTERM) and "Application shutdown complete" in output, output
