"""The CPU compose stack, end to end in containers (run by scripts/compose-check).

1. build every image (docker-compose.yml + docker-compose.cpu.yml);
2. up, and wait until every service is healthy;
3. train ``--steps`` steps (the learner's /v1/status);
4. every rollout replica and the scorer reach the learner's weight version (the engine
   registry in Redis: each entry's weight_version);
5. scale rollout to 3 (a third replica registers) and back to 2;
6. kill -9 a replica holding a task, and wait until that task is done by the stack;
7. down, volumes included (unless ``--keep``).

Prints one JSON line: build_s, healthy_s, steps_s (from `up` to the steps), steps, version, versions (entry id ->
weight version), scaled_to, redone_task, redo_s, total_s, errors, ok. Exits 1 unless ok.
Run through scripts/compose-check, which sets up Docker, the base image and the wheels.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROJECT = "mempo-check"


class CheckFailed(Exception):
    pass


def log(message: str) -> None:
    print(f"[compose-check] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_env(folder: Path, learner_port: int) -> Path:
    """A .env for the check: strong random secrets, the shipped tiny model, small sizes."""
    values = {
        "MEMPO_REDIS_PASSWORD": secrets.token_hex(16),
        "MEMPO_REDIS_LEARNER_PASSWORD": secrets.token_hex(16),
        "MEMPO_REDIS_ROLLOUT_PASSWORD": secrets.token_hex(16),
        "MEMPO_REDIS_SCORER_PASSWORD": secrets.token_hex(16),
        "MEMPO_SCORER_ADMIN_TOKEN": secrets.token_hex(16),
        "MEMPO_WORKER_ADMIN_TOKEN": secrets.token_hex(16),
        "MEMPO_MODEL": "/opt/mempo/tiny",
        "MEMPO_MODELS_DIR": str(folder / "models"),
        "MEMPO_DATA_DIR": str(folder / "data"),
        "MEMPO_BASE_IMAGE": os.environ.get("MEMPO_BASE_IMAGE", "python:3.11-slim"),
        "MEMPO_QUESTIONS_PER_TASK": "1",
        "MEMPO_GROUP_SIZE": "2",
        "MEMPO_BATCH_GROUPS": "2",
        "MEMPO_MAX_STALENESS": "1",
        "MEMPO_MAX_ROUNDS": "2",
        "MEMPO_MAX_NEW_TOKENS": "64",
        "MEMPO_LR": "3e-4",
        "MEMPO_CLAIM_IDLE_MS": "15000",
        "MEMPO_RETRIEVAL_PORT": str(free_port()),
        "MEMPO_LEARNER_PORT": str(learner_port),
    }
    for name in ("models", "data"):
        (folder / name).mkdir(exist_ok=True)
    env = folder / ".env"
    env.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return env


class Stack:
    def __init__(self, env: Path, learner_port: int) -> None:
        self.env, self.learner_port = env, learner_port

    def compose(self, *args: str, timeout: float = 1800, capture: bool = False) -> str:
        command = ["docker", "compose", "-p", PROJECT, "--env-file", str(self.env),
                   "-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml", *args]  # fmt: skip
        result = subprocess.run(
            command, cwd=REPO, timeout=timeout, text=True,
            stdout=subprocess.PIPE if capture else sys.stderr, stderr=subprocess.PIPE if capture else sys.stderr,
        )  # fmt: skip
        if result.returncode != 0:
            detail = (result.stderr or "")[-2000:] if capture else "(output above)"
            raise CheckFailed(f"docker compose {' '.join(args[:2])} exited {result.returncode}: {detail}")
        return result.stdout or ""

    def redis(self, *args: str) -> list[str]:
        """redis-cli in the redis container (its REDISCLI_AUTH holds the password): the
        reply's lines (--raw: one element a line)."""
        out = self.compose("exec", "-T", "redis", "redis-cli", "--raw", *args, capture=True, timeout=60)
        return [line for line in out.splitlines() if line.strip()]

    def status(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.learner_port}/v1/status"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return dict(json.loads(reply.read()))

    def engines(self) -> dict[str, dict[str, Any]]:
        """The registry: entry id -> {role, weight_version, ...} (an entry that expires
        between SCAN and MGET is an empty line, left out)."""
        keys = self.redis("--scan", "--pattern", "mempo:engines:*")
        entries = [json.loads(raw) for raw in self.redis("MGET", *keys)] if keys else []
        return {entry["id"]: entry for entry in entries}

    def pending(self) -> list[tuple[str, str]]:
        """(task entry id, consumer) of every task claimed and not yet done: XPENDING's
        rows are (id, consumer, idle ms, deliveries)."""
        return [(row[0], row[1]) for row in _rows(self.redis("XPENDING", "mempo:tasks", "rollout", "-", "+", "100"), 4)]

    def registered(self, engine_id: str) -> bool:
        return engine_id in self.engines()

    def rollout_containers(self) -> list[str]:
        return self.compose("ps", "-q", "rollout", capture=True).split()

    def diagnostics(self) -> dict[str, Any]:
        """What a failed check needs to be understood: the claimed tasks (entry, consumer,
        idle ms, deliveries), the task stream's consumers, the stream lengths, each
        replica's worker status (consuming, in flight, why not ready) and the learner's."""
        found: dict[str, Any] = {}
        probes: dict[str, Callable[[], Any]] = {
            "pending_tasks": lambda: [
                dict(zip(("entry", "consumer", "idle_ms", "deliveries"), row, strict=True))
                for row in _rows(self.redis("XPENDING", "mempo:tasks", "rollout", "-", "+", "100"), 4)
            ],
            "task_consumers": lambda: self.redis("XINFO", "CONSUMERS", "mempo:tasks", "rollout"),
            "stream_lengths": lambda: {s: self.redis("XLEN", f"mempo:{s}") for s in ("tasks", "groups", "dead")},
            "workers": lambda: {c[:12]: _worker_status(c) for c in self.rollout_containers()},
            "learner": self.status,
        }
        for name, probe in probes.items():
            try:
                found[name] = probe()
            except (CheckFailed, OSError, ValueError, subprocess.SubprocessError) as exc:
                found[name] = f"unavailable: {exc}"[:300]
        return found


def _rows(flat: list[str], width: int) -> list[list[str]]:
    return [flat[i : i + width] for i in range(0, len(flat) - width + 1, width)]


def _worker_status(container: str) -> Any:
    """GET /v1/status of the worker inside a replica (its port is not published)."""
    probe = "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8003/v1/status', timeout=5).read().decode())"
    result = subprocess.run(["docker", "exec", container, "python3", "-c", probe],
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    if result.returncode != 0:
        return f"unavailable: {result.stderr.strip()[-300:]}"
    status = json.loads(result.stdout)
    keep = ("ready", "reason", "consuming", "in_flight_tasks", "tasks_done", "tasks_failed", "engine_weight_version")
    return {k: status.get(k) for k in keep}


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if (value := check()) is not None and value is not False:
                return value
        except (OSError, CheckFailed, ValueError, KeyError) as exc:
            last = exc
        time.sleep(every)
    raise CheckFailed(f"timed out after {timeout:.0f}s waiting for {what}" + (f" (last error: {last})" if last else ""))


def run(stack: Stack, steps: int, report: dict[str, Any]) -> None:
    started = time.monotonic()
    log("building the images")
    stack.compose("build")
    report["build_s"] = round(time.monotonic() - started, 1)

    mark = time.monotonic()
    log("starting the stack, waiting for every service to be healthy")
    stack.compose("up", "-d", "--wait", "--wait-timeout", "900")
    report["healthy_s"] = round(time.monotonic() - mark, 1)
    log(f"training {steps} steps")

    def trained() -> dict[str, Any] | None:
        status = stack.status()
        if status["state"] == "failed":
            raise CheckFailed(f"the learner failed: {status['error']}")
        log(f"learner: state {status['state']}, step {status['step']}, in flight {status['in_flight']}")
        return status if status["step"] >= steps else None

    status = wait_for(f"{steps} training steps", trained, timeout=1200, every=10)
    report["steps_s"] = round(time.monotonic() - mark, 1)  # from `up`: rollouts start before all are healthy
    report["steps"], report["version"] = status["step"], status["version"]

    target = status["version"]
    log(f"waiting for both replicas and the scorer to load version {target}")

    def caught_up() -> dict[str, int] | None:
        entries = stack.engines()
        versions = {eid: int(e["weight_version"]) for eid, e in entries.items()}
        roles = [e["role"] for e in entries.values()]
        ok = roles.count("rollout") >= 2 and "scorer" in roles and min(versions.values()) >= target
        return versions if ok else None

    report["versions"] = wait_for(f"every engine at version {target}", caught_up, timeout=300, every=3)

    log("scaling rollout to 3")
    stack.compose("up", "-d", "--no-recreate", "--scale", "rollout=3", "--wait", "--wait-timeout", "600", "rollout")
    wait_for("a third rollout replica in the registry", lambda: len(stack.rollout_containers()) == 3
             and sum(e["role"] == "rollout" for e in stack.engines().values()) >= 3, timeout=300, every=3)  # fmt: skip
    report["scaled_to"] = 3
    stack.compose("up", "-d", "--no-recreate", "--scale", "rollout=2", "rollout")
    if len(stack.rollout_containers()) != 2:
        raise CheckFailed(f"scaling back left {len(stack.rollout_containers())} rollout replicas")

    kill_a_replica_holding_a_task(stack, report)
    final = stack.status()
    if final["state"] == "failed":
        raise CheckFailed(f"the learner failed: {final['error']}")
    report["final_step"] = final["step"]


def kill_a_replica_holding_a_task(stack: Stack, report: dict[str, Any]) -> None:
    """kill -9 a rollout replica while it holds a task, then wait until the stack has done
    that task (``redone_task``, ``redo_s``: from the kill)."""
    log("killing a replica that holds a task")
    for _attempt in range(5):
        containers = {c[:12]: c for c in stack.rollout_containers()}  # the worker id is the hostname

        def victim(live: dict[str, str] = containers) -> tuple[str, str] | None:
            return next(((entry, who) for entry, who in stack.pending() if who in live), None)

        entry, consumer = wait_for("a replica holding a task", victim, timeout=300, every=1)
        subprocess.run(["docker", "kill", "--signal", "KILL", containers[consumer]], check=True, capture_output=True)
        mark = time.monotonic()
        # the task must still be the dead replica's: one it acked before the kill landed proves nothing
        if (entry, consumer) in stack.pending():
            break
        # Start it again before the next try (docker does not restart a container it was
        # told to kill): two kills would leave no replica to redo the task, and the check
        # would wait for a task nobody can run (how it failed on a loaded machine).
        log(f"{consumer} finished task {entry} before the kill landed; restarting it, then another try")
        subprocess.run(["docker", "start", containers[consumer]], check=True, capture_output=True)
        wait_for(f"{consumer} back in the registry", functools.partial(stack.registered, consumer), timeout=300, every=2)
    else:
        raise CheckFailed("no replica could be killed while it held a task")
    log(f"killed {consumer} holding task {entry}; waiting until the task is done")
    wait_for(f"task {entry} done", lambda: entry not in {e for e, _ in stack.pending()}, timeout=600, every=3)
    report["redone_task"], report["redo_s"] = entry, round(time.monotonic() - mark, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps to wait for")
    parser.add_argument("--keep", action="store_true", help="leave the stack running")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    report: dict[str, Any] = {"errors": []}
    started = time.monotonic()
    folder = REPO / "runs" / "compose-check"  # the .env stays: `--keep` leaves a stack to inspect
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    stack = Stack(write_env(folder, port), port)
    try:
        run(stack, args.steps, report)
    except (CheckFailed, subprocess.SubprocessError, OSError) as exc:
        report["errors"].append(str(exc))
        report["diagnostics"] = stack.diagnostics()
        log("diagnostics: " + json.dumps(report["diagnostics"], indent=1))
        with contextlib.suppress(CheckFailed, subprocess.SubprocessError):
            stack.compose("logs", "--tail", "30")
    finally:
        if not args.keep:
            log("tearing down (volumes included)")
            try:
                stack.compose("down", "-v", "--remove-orphans", "--timeout", "20")
            except (CheckFailed, subprocess.SubprocessError) as exc:
                report["errors"].append(f"teardown: {exc}")
    report["total_s"] = round(time.monotonic() - started, 1)
    report["ok"] = not report["errors"]
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
