"""Helpers of the learner service tests: groups, stand-in engines served over real HTTP."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mempo.procs import free_port
from mempo.schemas import Group, Round, Task, Trajectory

VOCAB = 1024  # token ids below this are in the tiny model's vocabulary (about 1,200 tokens)


def make_group(
    task: Task | None = None,
    policy_version: int = 0,
    seed: int = 0,
    rounds: int = 2,
    prompt_len: int = 24,
    response_len: int = 16,
) -> Group:
    """A wire-valid group of ``task.n`` trajectories with varied rewards and memories."""
    rng = random.Random(seed)
    task = task or Task(questions=["In which city was Ka Ri born?"], answers=[["Zor"]], n=4)
    trajectories = []
    for i in range(task.n):
        rs = []
        for t in range(rounds):
            last = t == rounds - 1
            rs.append(
                Round(
                    index=t,
                    prompt_ids=[rng.randrange(10, VOCAB) for _ in range(prompt_len)],
                    response_ids=[rng.randrange(10, VOCAB) for _ in range(response_len)],
                    response_logprobs=[-rng.uniform(0.1, 3.0) for _ in range(response_len)],
                    mem_span=(1, 1 + response_len // 2),
                    action="answer" if last else "search",
                    query=None if last else f"query {i} {t}",
                    information=None if last else f"Doc 1(Title: X) text {t}",
                    weight_version=str(policy_version),
                )
            )
        correct = (i + seed) % 2 == 0
        trajectories.append(
            Trajectory(
                rounds=rs,
                answer_text="Zor" if correct else "Nope",
                reward=float(correct),
                correct=correct,
                format_ok=True,
                p_mem=[rng.uniform(0.1, 0.9) for _ in range(rounds)],
                p_full=[rng.uniform(0.1, 0.9) for _ in range(rounds)],
                num_tokens=rounds * (prompt_len + response_len),
            )
        )
    return Group(
        group_id=task.group_id,
        task=task,
        trajectories=trajectories,
        policy_version=policy_version,
        worker_id="test-worker",
    )


@dataclass
class StandInEngine:
    """An engine (or scorer) speaking /update_weights_from_disk and /model_info, recording calls."""

    name: str
    fail: bool = False
    admin_token: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    weight_version: str = "default"
    url: str = ""

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/update_weights_from_disk")
        async def update(request: Request) -> JSONResponse:
            body = await request.json()
            auth = request.headers.get("authorization")
            self.calls.append({**body, "authorization": auth})
            if self.admin_token and auth != f"Bearer {self.admin_token}":
                return JSONResponse({"message": "wrong admin token"}, 403)
            if self.fail:
                return JSONResponse({"success": False, "message": f"{self.name} cannot load"}, 400)
            self.weight_version = body["weight_version"]
            return JSONResponse({"success": True, "message": "ok"})

        @app.get("/model_info")
        async def model_info() -> dict[str, Any]:
            return {"model_path": "tiny", "weight_version": self.weight_version}

        return app


@contextmanager
def serving(apps: list[FastAPI]) -> Iterator[list[str]]:
    """Serve ASGI apps with uvicorn on free loopback ports, each in a thread; yields URLs.

    They start one after another: transformers' model loading is not thread-safe (its
    meta-device init is process-global), and real engines load a model at startup.
    """
    servers: list[uvicorn.Server] = []
    threads: list[threading.Thread] = []
    urls: list[str] = []
    try:
        for app in apps:
            port = free_port()
            config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
            server = uvicorn.Server(config)
            thread = threading.Thread(target=lambda s=server: asyncio.run(s.serve()), daemon=True)
            thread.start()
            servers.append(server)
            threads.append(thread)
            urls.append(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 60
            while not server.started:
                if time.monotonic() > deadline or not thread.is_alive():
                    raise RuntimeError(f"server {len(urls)} of {len(apps)} did not start")
                time.sleep(0.02)
        yield urls
    finally:
        for server in servers:
            server.should_exit = True
        for thread in threads:
            thread.join(timeout=10)
