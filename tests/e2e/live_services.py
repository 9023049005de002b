"""Real service processes for the security and schemathesis tests (this module holds no tests).

- ``start_http_stack``: retrieval, scorer, CPU engine, an HTTP-only rollout worker and the
  learner as child processes of a ``Supervisor``, every one with an admin token, each
  waited for until ready.
- ``find_secrets``: every place under a folder where a secret string occurs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mempo.procs import free_port
from mempo_cli.launcher.supervisor import Child, Supervisor

SERVICES = ("retrieval", "scorer", "engine", "worker", "learner")


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
            ADMIN_TOKEN=token, THREADS=1, CONTEXT_LENGTH=engine_context, DRAIN_TIMEOUT_S=2,
            WEIGHT_SYNC_TIMEOUT_S=1)),  # a group join with no learner behind it gives up fast
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
            ADMIN_TOKEN=token, WORKER_ADMIN_TOKEN=token, SCORER_ADMIN_TOKEN=token, GROUP_SIZE=2,
            BATCH_GROUPS=1,
            DRAIN_TIMEOUT_S=2)),
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


def refused(token: str, wrong: str) -> list[tuple[dict[str, str], int]]:
    """Authorization headers that must not pass ``token``'s check (``wrong``: another
    token), and the status each gets."""
    return [
        ({}, 401),
        ({"Authorization": "Bearer"}, 401),
        ({"Authorization": "Bearer "}, 401),
        ({"Authorization": f"Basic {token}"}, 401),
        ({"Authorization": token}, 401),
        ({"Authorization": f"Bearer {wrong}"}, 403),
        ({"Authorization": f"Bearer {token[:-1]}"}, 403),
        ({"Authorization": f"Bearer {token}x"}, 403),
        ({"Authorization": f"Bearer {token.upper()}"}, 403),
    ]
