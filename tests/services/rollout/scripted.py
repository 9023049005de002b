"""Stand-ins for the worker's upstreams, speaking their real HTTP contracts.

- ScriptedEngine: SGLang's /generate, /model_info, /server_info and
  /update_weights_from_disk as a FastAPI app; it answers with a script (by default the
  world's oracle reading the decoded prompt) through services.rollout.scripted's
  SGLang-shaped reply, and records every (input_ids, output_ids) pair.
- retrieval_app: Search-R1's POST /retrieve over mempo.bm25.LocalSearch.
- ScriptedScorer: POST /v1/memory-scores with deterministic probabilities, or a failure.

All of them are served in-process through httpx.ASGITransport.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mempo.agent_format import DEFAULT_TAGS
from mempo.api.retrieval import RetrieveRequest
from mempo.api.scorer import MemoryScoresRequest, MemoryScoresResponse, RoundScore, TrajectoryScores
from mempo.bm25 import LocalSearch
from mempo.clients.engine import EngineClient
from mempo.clients.retrieval import RetrievalClient
from mempo.clients.scorer import ScorerClient
from mempo.queue import RedisQueue
from mempo_sim.oracle import Oracle
from mempo_sim.world import World
from services.rollout.scripted import Script, scripted_reply
from services.rollout.settings import WorkerSettings
from services.rollout.upstreams import Upstreams
from services.rollout.worker import RolloutWorker


class ScriptedEngine:
    def __init__(
        self,
        tokenizer: Any,
        script: Script,
        weight_version: str = "0",
        context_length: int = 16384,
        model_path: str = "/weights/tiny",
    ) -> None:
        self.tok = tokenizer
        self.script = script
        self.weight_version = weight_version
        self.context_length = context_length
        self.model_path = model_path
        self.calls: list[tuple[list[int], list[int]]] = []
        self.updates: list[dict[str, Any]] = []
        self.gate: asyncio.Event | None = None  # when set to an unset Event, /generate hangs
        self.aborts_left = 0  # answer this many requests with finish_reason abort
        self.delay_s = 0.0  # per /generate
        self.fail_status: int | None = None  # answer /generate with this HTTP error
        self.in_flight = 0
        self.app = self._build()

    @classmethod
    def oracle(cls, tokenizer: Any, world: World, mode: str, **kw: Any) -> ScriptedEngine:
        oracle = Oracle(world)
        return cls(tokenizer, lambda prompt: oracle.respond_to_prompt(prompt, mode), **kw)

    def client(self, admin_token: str | None = None) -> EngineClient:
        return EngineClient(
            "http://engine", admin_token=admin_token, client=asgi_client(self.app), attempts=1
        )

    def respond(self, input_ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        text = self.script(self.tok.decode(input_ids, skip_special_tokens=True))
        reply = scripted_reply(self.tok, text, input_ids, params, self.weight_version)
        if self.aborts_left > 0:
            self.aborts_left -= 1
            reply["output_ids"] = reply["output_ids"][:2]
            reply["meta_info"]["output_token_logprobs"] = reply["meta_info"]["output_token_logprobs"][:2]
            reply["meta_info"]["finish_reason"] = {"type": "abort", "message": "aborted"}
        self.calls.append((list(input_ids), list(reply["output_ids"])))
        return reply

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body = await request.json()
            params = body.get("sampling_params") or {}
            input_ids = body["input_ids"]
            if self.fail_status is not None:
                return JSONResponse({"error": {"message": "engine broken"}}, self.fail_status)
            if len(input_ids) + int(params.get("max_new_tokens", 128)) > self.context_length:
                message = (
                    f"The input ({len(input_ids)} tokens) is longer than the model's context "
                    f"length ({self.context_length} tokens)."
                )
                return JSONResponse({"error": {"message": message}}, 400)
            self.in_flight += 1
            try:
                if self.gate is not None:
                    await self.gate.wait()
                await asyncio.sleep(self.delay_s)
            finally:
                self.in_flight -= 1
            return self.respond(input_ids, params)

        @app.get("/model_info")
        async def model_info() -> dict[str, Any]:
            return {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "weight_version": self.weight_version,
            }

        @app.get("/server_info")
        async def server_info() -> dict[str, Any]:
            return {"context_length": self.context_length}

        @app.post("/update_weights_from_disk")
        async def update(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.updates.append({**body, "authorization": request.headers.get("authorization")})
            self.weight_version = str(body["weight_version"])
            return {"success": True, "message": "ok"}

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {}

        return app


def retrieval_app(search: LocalSearch) -> FastAPI:
    app = FastAPI()

    @app.post("/retrieve")
    async def retrieve(body: RetrieveRequest) -> dict[str, Any]:
        return {"result": search.retrieve(body.queries, body.topk or 3)}

    return app


class ScriptedScorer:
    """P_mem = 0.9 when the memory holds a found value ('>' or a digit), else 0.2; P_full 0.5;
    ``p_task`` for every trajectory of a request with task_score (None: answers none)."""

    def __init__(self, fail_status: int | None = None, p_task: float | None = 0.1) -> None:
        self.fail_status = fail_status
        self.p_task = p_task
        self.requests: list[MemoryScoresRequest] = []
        self.app = FastAPI()

        @self.app.post("/v1/memory-scores")
        async def scores(body: MemoryScoresRequest) -> Any:
            self.requests.append(body)
            if self.fail_status is not None:
                return JSONResponse({"message": "scorer down"}, self.fail_status)
            return MemoryScoresResponse(
                results=[
                    TrajectoryScores(
                        rounds=[
                            RoundScore(
                                index=i,
                                p_mem=None if r.memory is None else _p_mem(r.memory),
                                p_full=0.5,
                                reward=None if r.memory is None else _p_mem(r.memory) - 0.5,
                                mem_context_tokens=None if r.memory is None else 10,
                                full_context_tokens=10 + i,
                            )
                            for i, r in enumerate(t.rounds)
                        ],
                        candidates=["x"],
                        p_task=self.p_task if body.task_score else None,
                    )
                    for t in body.trajectories
                ],
                weight_version="7",
            )

    def client(self) -> ScorerClient:
        return ScorerClient("http://scorer", attempts=1, client=asgi_client(self.app))


def _p_mem(memory: str) -> float:
    return 0.9 if (">" in memory or any(c.isdigit() for c in memory)) else 0.2


def asgi_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=30.0)


def upstreams(
    engine: ScriptedEngine,
    search: LocalSearch,
    scorer: ScriptedScorer | None = None,
    admin_token: str | None = None,
) -> Upstreams:
    return Upstreams(
        engine=engine.client(admin_token),
        retrieval=RetrievalClient("http://retrieval", client=asgi_client(retrieval_app(search))),
        scorer=scorer.client() if scorer else None,
    )


def worker_settings(**overrides: Any) -> WorkerSettings:
    """Test defaults: no Redis, no scorer, short timings."""
    values: dict[str, Any] = {
        "redis_url": "",
        "scorer_url": "",
        "max_new_tokens": 256,
        "temperature": 0.0,
        "claim_block_ms": 50,
        "heartbeat_s": 0.1,
        "drain_timeout_s": 5.0,
    }
    values.update(overrides)
    return WorkerSettings(**values)


@asynccontextmanager
async def booted_worker(
    engine: ScriptedEngine,
    search: LocalSearch,
    tokenizer: Any,
    scorer: ScriptedScorer | None = None,
    queue: RedisQueue | None = None,
    **overrides: Any,
) -> AsyncIterator[RolloutWorker]:
    """A booted worker on the stand-ins (no background loop: call run() / run_task())."""
    if scorer is not None:
        overrides.setdefault("scorer_url", "http://scorer")
    settings = worker_settings(**overrides)
    clients = upstreams(engine, search, scorer, settings.engine_admin_token_value())
    worker = RolloutWorker(settings, clients, queue, tokenizer=tokenizer)
    await worker.boot()
    try:
        yield worker
    finally:
        await clients.aclose()
        await clients.engine.http.aclose()
        await clients.retrieval.http.aclose()
        if clients.scorer is not None:
            await clients.scorer.http.aclose()


def question_tail(prompt_text: str) -> str:
    """The prompt after its last "Question: " (the instructions quote the tags too)."""
    return prompt_text[prompt_text.rfind("Question: ") :]


def tag_count(text: str, name: str) -> int:
    return text.count(DEFAULT_TAGS.open(name))
