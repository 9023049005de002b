"""The rollout worker installs and runs without torch: a fresh venv with only
``mempo[worker]`` runs episodes against a real CPU engine and a real retrieval process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mempo.procs import free_port, wait_ready
from mempo.schemas import Group, Task
from mempo_sim.world import World
from services.rollout.engine.inprocess import EngineThread
from tests.conftest import REPO
from tests.services.rollout.test_engine_support import ADMIN, engine_settings

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def worker_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding mempo[worker] and nothing of the model stack (about 30 s)."""
    venv = tmp_path_factory.mktemp("worker-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "-c", str(REPO / "constraints" / "cpu.txt"), f"{REPO}[worker]"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    return python


def test_the_worker_extra_holds_no_torch_and_runs_episodes(
    worker_venv: Path, tiny_model_dir: Path, world: World, tmp_path: Path
) -> None:
    missing = subprocess.run(
        [str(worker_venv), "-c", "import importlib.util as u; print([m for m in "
         "('torch', 'matplotlib', 'pyarrow', 'bm25s') if u.find_spec(m)])"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.stdout.strip() == "[]", missing.stdout + missing.stderr

    retrieval_port, worker_port = free_port(), free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_")}
    logs = {name: (tmp_path / f"{name}.log").open("wb") for name in ("retrieval", "worker")}
    procs: list[subprocess.Popen[bytes]] = []
    with EngineThread(engine_settings(tiny_model_dir, context_length=2048)) as engine:
        try:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "mempo_cli", "retrieval", "serve"], cwd=REPO,
                env={**clean, "MEMPO_RETRIEVAL_PORT": str(retrieval_port)},
                stdout=logs["retrieval"], stderr=subprocess.STDOUT,
            ))  # fmt: skip
            procs.append(subprocess.Popen(
                [str(worker_venv), "-m", "mempo_cli", "rollout", "worker"], cwd=tmp_path,
                env={**clean, "HF_HUB_OFFLINE": "1", "MEMPO_ROLLOUT_PORT": str(worker_port),
                     "MEMPO_ROLLOUT_REDIS_URL": "", "MEMPO_ROLLOUT_SCORER_URL": "",
                     "MEMPO_ROLLOUT_ENGINE_URL": engine, "MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN": ADMIN,
                     "MEMPO_ROLLOUT_RETRIEVAL_URL": f"http://127.0.0.1:{retrieval_port}",
                     "MEMPO_ROLLOUT_TOKENIZER_PATH": str(tiny_model_dir),
                     "MEMPO_ROLLOUT_MAX_NEW_TOKENS": "32"},
                stdout=logs["worker"], stderr=subprocess.STDOUT,
            ))  # fmt: skip
            wait_ready(f"http://127.0.0.1:{retrieval_port}", timeout_s=60, proc=procs[0])
            wait_ready(f"http://127.0.0.1:{worker_port}", timeout_s=120, proc=procs[1])
            (questions, answers), = world.tasks("test", 1, 1, seed=5)
            task = Task(questions=questions, answers=answers, n=2, max_rounds=2)
            reply = httpx.post(
                f"http://127.0.0.1:{worker_port}/v1/episodes",
                json={"task": task.model_dump(mode="json"), "score": False}, timeout=300,
            )  # fmt: skip
            assert reply.status_code == 200, reply.text
            group = Group.model_validate(reply.json())
            assert len(group.trajectories) == 2 and all(t.rounds for t in group.trajectories)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            for handle in logs.values():
                handle.close()
    worker_log = (tmp_path / "worker.log").read_text()
    assert "Traceback" not in worker_log, worker_log[-3000:]
