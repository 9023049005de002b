"""Settings, start-up discovery of the engine, and the benchmarks' scripted upstreams."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from mempo.bm25 import LocalSearch
from mempo.clients.engine import EngineClient
from mempo.schemas import Task
from mempo_sim.oracle import Oracle
from mempo_sim.world import World
from services.rollout.scripted import ScriptedUpstreams
from services.rollout.settings import WorkerSettings
from services.rollout.upstreams import FALLBACK_CONTEXT, Upstreams, context_length
from services.rollout.worker import RolloutWorker


def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMPO_ROLLOUT_PORT", "9031")
    monkeypatch.setenv("MEMPO_ROLLOUT_SCORER_URL", "")
    monkeypatch.setenv("MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN", "t0k")
    monkeypatch.setenv("MEMPO_ROLLOUT_MAX_CONCURRENT_EPISODES", "7")
    settings = WorkerSettings()
    assert settings.port == 9031 and settings.max_concurrent_episodes == 7
    assert settings.worker_id and settings.engine_url == "http://127.0.0.1:30000"
    clients = Upstreams.from_settings(settings)
    assert clients.scorer is None and clients.engine.admin_token == "t0k"
    assert "t0k" not in repr(settings)
    with pytest.raises(ValueError, match="max_new_tokens"):
        WorkerSettings(max_new_tokens=0)


@pytest.mark.parametrize(
    ("server_info", "expected"),
    [
        ({"context_length": 8192}, 8192),  # the CPU engine; SGLang with --context-length
        ({"context_length": None, "max_req_input_len": 4095}, 4096),  # SGLang's default
        ({"context_length": None, "internal_states": [{"max_req_input_len": 2047}]}, 2048),
        (None, FALLBACK_CONTEXT),  # no /server_info at all
    ],
)
async def test_the_context_length_is_read_from_the_engine(
    server_info: dict[str, Any] | None, expected: int
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if server_info is None or request.url.path != "/server_info":
            return httpx.Response(404, json={"message": "no"})
        return httpx.Response(200, json=server_info)

    client = EngineClient("http://e", client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    assert await context_length(client) == expected


@pytest.mark.parametrize("mode", ["memory", "full"])
async def test_the_benchmarks_scripted_upstreams_drive_a_worker(
    mode: str, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    oracle = Oracle(world)
    stand_ins = ScriptedUpstreams(tokenizer, lambda p: oracle.respond_to_prompt(p, mode), local_search)
    settings = WorkerSettings(redis_url="", scorer_url="http://scorer", temperature=0.0)
    worker = RolloutWorker(settings, stand_ins.upstreams(), None, tokenizer=tokenizer)
    await worker.boot()
    (questions, answers), = world.tasks("test", 3, 1, seed=61)
    group = await worker.run_task(Task(questions=questions, answers=answers, n=2, mode=mode, max_rounds=16))
    await worker.upstreams.aclose()
    assert all(t.correct for t in group.trajectories)
    assert stand_ins.generations == sum(len(t.rounds) for t in group.trajectories)
    assert [len(t.p_mem) for t in group.trajectories] == (
        [len(t.rounds) for t in group.trajectories] if mode == "memory" else [0, 0]
    )
