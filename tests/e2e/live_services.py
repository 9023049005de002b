"""Real service processes for the security and schemathesis tests (this module holds no tests).

- ``PasswordRedis``: a private redis-server that requires a password (``--requirepass``).
- ``start_http_stack``: retrieval, scorer, CPU engine, an HTTP-only rollout worker and the
  learner as child processes of a ``Supervisor``, every one with an admin token, each
  waited for until ready.
- ``find_secrets``: every place under a folder where a secret string occurs.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from mempo.launcher.supervisor import Child, Supervisor
from mempo.procs import free_port

SERVICES = ("retrieval", "scorer", "engine", "worker", "learner")


class PasswordRedis:
    """redis-server on a free loopback port that refuses clients without ``password``; its
    append-only file keeps the data across ``stop`` and ``start``."""

    def __init__(self, directory: Path, password: str) -> None:
        self.directory = directory
        self.password = password
        self.port = free_port()  # kept across restarts
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> PasswordRedis:
        binary = shutil.which("redis-server")
        assert binary is not None, "redis-server is not on PATH"
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes", "--dir", str(self.directory),
            "--logfile", str(self.directory / "redis.log"), "--requirepass", self.password,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"redis-server exited with {self.proc.returncode}"
            if self.ping() == b"+PONG":
                return self
            time.sleep(0.05)
        raise TimeoutError(f"redis-server did not answer on port {self.port}")

    def ping(self, password: str | None = None) -> bytes:
        """The first reply line of PING, after AUTH with ``password`` (default: the right
        one; ``""``: no AUTH at all)."""
        password = self.password if password is None else password
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                if password:
                    sock.sendall(f"AUTH {password}\r\n".encode())
                    sock.recv(256)
                sock.sendall(b"PING\r\n")
                return sock.recv(256).split(b"\r\n")[0]
        except OSError:
            return b""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None


@dataclass
class HttpStack:
    urls: dict[str, str]  # service name -> base URL
    children: dict[str, Child]
    weights_root: Path
    model: Path
    token: str


def start_http_stack(
    sup: Supervisor,
    run_dir: Path,
    model: Path,
    redis_url: str,
    token: str,
    prefix: str,
    engine_context: int = 1024,
    worker_new_tokens: int = 24,
    ready_timeout_s: float = 240.0,
) -> HttpStack:
    """Every service with an admin token; the worker serves HTTP only (no Redis), on the
    engine, retrieval and scorer of this stack, so its episodes run the real code paths."""
    weights = run_dir / "weights"
    weights.mkdir(parents=True, exist_ok=True)
    ports = {name: free_port() for name in SERVICES}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    base = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def env(prefix_: str, **values: object) -> dict[str, str]:
        return {**base, **{f"MEMPO_{prefix_}_{k}": str(v) for k, v in values.items()}}

    first = {
        "retrieval": sup.start("retrieval", ["mempo", "retrieval", "serve"], url=urls["retrieval"],
                               env=env("RETRIEVAL", PORT=ports["retrieval"], ADMIN_TOKEN=token)),
        "scorer": sup.start("scorer", ["mempo", "scorer", "serve"], url=urls["scorer"], env=env(
            "SCORER", PORT=ports["scorer"], MODEL_PATH=model, WEIGHTS_ROOT=weights,
            ADMIN_TOKEN=token, DEVICE="cpu", MAX_WAIT_MS=1)),
        "engine": sup.start("engine", ["mempo", "rollout", "engine"], url=urls["engine"], env=env(
            "ENGINE", PORT=ports["engine"], MODEL_PATH=model, WEIGHTS_ROOT=weights,
            ADMIN_TOKEN=token, THREADS=1, CONTEXT_LENGTH=engine_context, DRAIN_TIMEOUT_S=2)),
    }  # fmt: skip
    sup.wait_ready(list(first.values()), ready_timeout_s)
    second = {
        "worker": sup.start("worker", ["mempo", "rollout", "worker"], url=urls["worker"], env=env(
            "ROLLOUT", PORT=ports["worker"], REDIS_URL="", CONSUME="false", WORKER_ID="fuzz-worker",
            ENGINE_URL=urls["engine"], ENGINE_ADMIN_TOKEN=token, RETRIEVAL_URL=urls["retrieval"],
            SCORER_URL=urls["scorer"], TOKENIZER_PATH=model, MAX_NEW_TOKENS=worker_new_tokens,
            ADMIN_TOKEN=token, DRAIN_TIMEOUT_S=2)),
        "learner": sup.start("learner", ["mempo", "learner", "serve"], url=urls["learner"], env=env(
            "LEARNER", PORT=ports["learner"], REDIS_URL=redis_url, KEY_PREFIX=prefix,
            MODEL_PATH=model, RUN_DIR=run_dir / "learner", WEIGHTS_ROOT=weights, DEVICE="cpu",
            ADMIN_TOKEN=token, ENGINE_ADMIN_TOKEN=token, GROUP_SIZE=2, BATCH_GROUPS=1,
            DRAIN_S=2)),
    }  # fmt: skip
    sup.wait_ready(list(second.values()), ready_timeout_s)
    return HttpStack(urls, {**first, **second}, weights, model, token)


def find_secrets(root: Path, secrets: dict[str, str]) -> list[str]:
    """``"<file>: <secret name>"`` for every file under ``root`` holding a secret's bytes."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        found += [f"{path}: {name}" for name, value in secrets.items() if value.encode() in data]
    return found
