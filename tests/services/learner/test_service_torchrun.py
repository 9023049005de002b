"""`mempo learner serve` under torchrun: 2 CPU ranks (FSDP2 on gloo), rank 0 serves."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mempo.keys import Keys
from mempo.procs import free_port, wait_ready
from mempo.queue import RedisQueue
from mempo.registry import EngineInfo
from tests.services.learner.service_support import StandInEngine, serving
from tests.services.learner.test_service_loop import roll_out

pytestmark = pytest.mark.e2e


async def _status(http: httpx.AsyncClient, url: str, done: object, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while not done(status := (await http.get(f"{url}/v1/status")).json()):  # type: ignore[operator]
        assert time.monotonic() < deadline, status
        await asyncio.sleep(0.2)
    return status  # type: ignore[no-any-return]


def _learner_env(
    redis_url: str, keys: Keys, port: int, model: Path, tmp_path: Path
) -> dict[str, str]:
    """The environment of ``mempo learner serve``: two steps of two groups of two, on CPU."""
    return {
        **os.environ,
        "MEMPO_LEARNER_REDIS_URL": redis_url,
        "MEMPO_LEARNER_KEY_PREFIX": keys.prefix,
        "MEMPO_LEARNER_PORT": str(port),
        "MEMPO_LEARNER_MODEL_PATH": str(model),
        "MEMPO_LEARNER_DEVICE": "cpu",
        "MEMPO_LEARNER_RUN_DIR": str(tmp_path / "run"),
        "MEMPO_LEARNER_WEIGHTS_ROOT": str(tmp_path / "weights"),
        "MEMPO_LEARNER_BATCH_GROUPS": "2",
        "MEMPO_LEARNER_GROUP_SIZE": "2",
        "MEMPO_LEARNER_TOTAL_STEPS": "2",
        "MEMPO_LEARNER_POLL_MS": "100",
        "OMP_NUM_THREADS": "1",
    }


async def test_two_ranks_train_and_rank_zero_publishes(
    redis_url: str, redis_client: object, keys: Keys, tmp_path: Path, tiny_model_dir: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = _learner_env(redis_url, keys, port, tiny_model_dir, tmp_path)
    engine = StandInEngine("engine")
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    log = (tmp_path / "torchrun.log").open("wb")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    proc = subprocess.Popen(
        [*command, "-m", "mempo_cli", "learner", "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        with serving([engine.app()]) as (engine_url,):
            await queue.register_engine(EngineInfo(id="engine", url=engine_url), ttl_s=300)
            await asyncio.to_thread(wait_ready, url, 180.0, "/ready", proc)
            async with httpx.AsyncClient(timeout=10) as http:
                for version in range(2):
                    await _status(
                        http,
                        url,
                        lambda s, v=version: s["consumed"] == 2 * v and s["admitted"] == 2 * v + 2,
                    )
                    assert await roll_out(queue, version) == 2
                status = await _status(http, url, lambda s: s["state"] == "finished")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        await queue.aclose()
    output = (tmp_path / "torchrun.log").read_text(errors="replace")
    assert (status["step"], status["version"], status["consumed"]) == (2, 2, 4), output[-3000:]
    assert "rank 1 of 2" in output  # the follower joined the process group
    assert [c["weight_version"] for c in engine.calls] == ["1", "2"]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v1", "v2"]
