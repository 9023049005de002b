"""The worker with the real services in-process: retrieval, scorer, the CPU engine, Redis."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
from fastapi import FastAPI

from mempo.agent_format import first_prompt_ids
from mempo.clients.engine import EngineClient
from mempo.clients.retrieval import RetrievalClient
from mempo.clients.scorer import ScorerClient
from mempo.keys import Keys
from mempo.queue import RedisQueue
from mempo.schemas import Group, Task
from mempo_sim.world import World
from services.retrieval.app import create_app as create_retrieval
from services.retrieval.settings import RetrievalSettings
from services.rollout.app import create_app as create_worker
from services.rollout.engine.app import create_app as create_engine
from services.rollout.engine.settings import EngineSettings
from services.rollout.upstreams import Upstreams
from services.rollout.worker import RolloutWorker
from services.scorer.app import create_app as create_scorer
from services.scorer.settings import ScorerSettings
from tests.services.rollout.scripted import ScriptedEngine, worker_settings


@asynccontextmanager
async def started(app: FastAPI, name: str) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan, behind an ASGI client; waits for /ready."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://{name}", timeout=120) as client:
            for _ in range(500):
                if (await client.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.02)
            yield client


@asynccontextmanager
async def retrieval_and_scorer(tiny_model_dir: Path) -> AsyncIterator[tuple[RetrievalClient, ScorerClient]]:
    retrieval = create_retrieval(RetrievalSettings(world_seed=0))
    scorer = create_scorer(ScorerSettings(model_path=str(tiny_model_dir), device="cpu"))
    async with started(retrieval, "retrieval") as rc, started(scorer, "scorer") as sc:
        yield RetrievalClient("http://retrieval", client=rc), ScorerClient("http://scorer", client=sc)


async def test_the_oracle_through_the_real_retrieval_and_scorer(
    tokenizer: Any, world: World, tiny_model_dir: Path
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    (questions, answers), = world.tasks("test", 3, 1, seed=31)
    task = Task(questions=questions, answers=answers, n=2, mode="memory", max_rounds=16)
    async with retrieval_and_scorer(tiny_model_dir) as (retrieval, scorer):
        clients = Upstreams(engine=engine.client(), retrieval=retrieval, scorer=scorer)
        worker = RolloutWorker(worker_settings(scorer_url="http://scorer"), clients, None, tokenizer=tokenizer)
        await worker.boot()
        group = await worker.run_task(task)
        with_task = await worker.run_task(task.model_copy(update={"score_task": True}))
    assert group.scorer_version == "0"
    assert {t.p_task for t in group.trajectories} == {None}  # not asked: not scored
    (p_task,) = {t.p_task for t in with_task.trajectories}  # asked: one per task
    assert p_task is not None and 0.0 < p_task < 1.0
    for traj in group.trajectories:
        assert traj.correct and traj.reward == 1.0
        assert len(traj.p_mem) == len(traj.p_full) == len(traj.rounds)
        assert all(0.0 < p <= 1.0 for p in [*traj.p_mem, *traj.p_full])
        assert all(r.information and r.information.startswith("Doc 1(Title:") for r in traj.rounds[:-1])


async def test_a_task_end_to_end_on_the_cpu_engine(
    redis_url: str, redis_client: Any, keys: Keys, tokenizer: Any, world: World, tiny_model_dir: Path
) -> None:
    """Untrained tiny model: the reward is likely 0; the records must still be exact."""
    feeder = RedisQueue(redis_client, keys, consumer="feeder")
    await feeder.ensure_groups()
    (questions, answers), = world.tasks("test", 2, 1, seed=41)
    task = Task(questions=questions, answers=answers, n=3, mode="memory", max_rounds=3)
    await feeder.publish_task(task)
    engine_app = create_engine(EngineSettings(model_path=str(tiny_model_dir), context_length=4096))
    async with started(engine_app, "engine") as ec, retrieval_and_scorer(tiny_model_dir) as (retrieval, scorer):
        clients = Upstreams(EngineClient("http://engine", client=ec), retrieval, scorer)
        settings = worker_settings(
            redis_url=redis_url,
            key_prefix=keys.prefix,
            scorer_url="http://scorer",
            temperature=1.0,
            max_new_tokens=40,
        )
        worker_app = create_worker(settings, clients, tokenizer=None)  # tokenizer: the engine's
        async with started(worker_app, "worker") as wc:
            for _ in range(3000):
                if (await feeder.stream_lengths())["groups"] == 1:
                    break
                await asyncio.sleep(0.02)
            status = (await wc.get("/v1/status")).json()
    failures = await redis_client.hgetall(keys.failures)  # why, if the task did not finish
    assert status["tasks_done"] == 1 and status["max_context_tokens"] == 4096, (status, failures)
    learner = RedisQueue(redis_client, keys, consumer="learner")
    (delivery,) = await learner.claim_groups(10, block_ms=None)
    group: Group = delivery.record
    assert group.task == task and len(group.trajectories) == 3 and group.policy_version == 0
    first = first_prompt_ids(tokenizer, questions)
    model = _load_model(tiny_model_dir)
    for traj in group.trajectories:
        assert traj.rounds[0].prompt_ids == first and 1 <= len(traj.rounds) <= 3
        assert len(traj.p_mem) == sum(r.mem_span is not None for r in traj.rounds)
        for r in traj.rounds:
            assert 1 <= len(r.response_ids) <= 40 and r.weight_version == "0"
            expected = _teacher_forced(model, r.prompt_ids.tolist(), r.response_ids.tolist())
            assert max(abs(a - b) for a, b in zip(r.response_logprobs, expected, strict=True)) < 1e-3
        assert traj.num_tokens == sum(len(r.prompt_ids) + len(r.response_ids) for r in traj.rounds)
        assert traj.reward in (0.0, 1.0) and all(math.isfinite(p) for p in traj.p_full)


def _load_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _teacher_forced(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    """log p(response token | everything before it), the reference for the engine's logprobs."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # (R, V)
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()
