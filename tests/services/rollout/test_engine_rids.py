"""Request ids and bad finishes between the client and an engine (issue 14, items 3, 4).

- A retried /generate carries a fresh rid (``<rid>-r<k>``): SGLang (and now the CPU
  engine) answers 400 "Duplicate request ID detected" while an id is still in flight.
  Checked on a real HTTP server that fails the first attempt, and on a real CPU engine
  whose first attempt times out while it is still queued.
- ``finish_reason {type: stop, matched: "NaN happened"}`` (SGLang's replacement of a
  token sampled from NaN logits) is an engine error: the episode fails, nothing is kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mempo.clients.engine import EngineClient, EngineError, EngineNaN
from mempo.schemas import Task
from services.rollout.engine.inprocess import EngineThread
from services.rollout.episode import EpisodeConfig, EpisodeRunner
from tests.services.learner.service_support import serving
from tests.services.rollout.test_engine_support import ADMIN, ADMIN_HEADERS, engine_settings

PARAMS = {"max_new_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "n": 1}


def answer(rid: str, finish: dict[str, Any]) -> dict[str, Any]:
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": 2, "weight_version": "0",
            "output_token_logprobs": [[-0.5, 3, None]]}  # fmt: skip
    return {"text": "x", "output_ids": [3], "meta_info": meta}


def standin(rids: list[str | None], fail_first: int, finish: dict[str, Any] | None = None) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        body = await request.json()
        rids.append(body.get("rid"))
        if len(rids) <= fail_first:
            return JSONResponse({"error": {"message": "busy"}}, 503)
        return JSONResponse(answer(body.get("rid") or "", finish or {"type": "length", "length": 1}))

    return app


async def test_each_retry_has_a_fresh_rid_with_the_base_as_prefix() -> None:
    rids: list[str | None] = []
    with serving([standin(rids, fail_first=2)]) as (url,):
        async with EngineClient(url, attempts=3, backoff_base_s=0.01) as client:
            [gen] = await client.generate([1, 2], PARAMS, rid="traj-0")
    assert rids == ["traj-0", "traj-0-r1", "traj-0-r2"]
    assert gen.rid == "traj-0-r2" and all(str(r).startswith("traj-0") for r in rids)
    rids.clear()
    with serving([standin(rids, fail_first=1)]) as (url,):
        async with EngineClient(url, attempts=2, backoff_base_s=0.01) as client:
            await client.generate([1, 2], PARAMS)  # no rid: none is invented
    assert rids == [None, None]


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with EngineThread(engine_settings(tiny_model_dir)) as url:
        yield url


async def test_the_cpu_engine_refuses_a_rid_in_flight(engine_url: str) -> None:
    body = {"input_ids": [5, 6], "rid": "dup", "sampling_params": PARAMS}
    async with httpx.AsyncClient(base_url=engine_url, timeout=60, headers=ADMIN_HEADERS) as http:
        await http.post("/pause_generation", json={"mode": "in_place"})
        first = asyncio.create_task(http.post("/generate", json=body))
        for _ in range(1000):  # until it is queued (generation is paused): at most 20 s
            if (await http.get("/server_info")).json()["internal_states"][0]["waiting"]:
                break
            assert not first.done(), f"the first request ended unqueued: {first.result()}"
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the first request was never queued")
        again = await http.post("/generate", json=body)
        assert again.status_code == 400
        assert again.json() == {"error": {"message": "Duplicate request ID detected: dup"}}
        await http.post("/continue_generation", json={})
        assert (await first).status_code == 200
        assert (await http.post("/generate", json=body)).status_code == 200  # free again


async def test_a_timed_out_attempt_does_not_block_its_retry(engine_url: str) -> None:
    """The first attempt waits (paused engine) past the client's read timeout; the engine
    notices the disconnect only at its next poll. The retry must not collide with it."""
    admin = EngineClient(engine_url, admin_token=ADMIN)
    client = EngineClient(engine_url, timeout_s=1.5, attempts=2, backoff_base_s=0.01)
    async with admin, client:
        await admin.pause_generation("in_place")
        call = asyncio.create_task(client.generate([5, 6, 7], PARAMS, rid="slow"))
        await asyncio.sleep(2.0)  # attempt 1 timed out at 1.5 s, the retry is queued
        await admin.continue_generation()
        [gen] = await asyncio.wait_for(call, 30)
    assert gen.rid == "slow-r1" and gen.finish_type == "length"


class NoSearch:
    async def search(self, query: str, topk: int | None = None) -> str:
        raise AssertionError("an episode whose generation failed must not search")


async def test_nan_happened_is_an_engine_error_never_a_round(tokenizer: Any) -> None:
    rids: list[str | None] = []
    nan = {"type": "stop", "matched": "NaN happened"}
    with serving([standin(rids, fail_first=0, finish=nan)]) as (url,):
        async with EngineClient(url, attempts=1) as client:
            with pytest.raises(EngineNaN, match="NaN happened"):
                await client.generate([1, 2], PARAMS, rid="r")
            runner = EpisodeRunner(client, NoSearch(), tokenizer, EpisodeConfig(max_new_tokens=3))
            with pytest.raises(EngineError, match="NaN"):
                await runner.run(Task(questions=["q"], answers=[["a"]], n=1))
    assert len(rids) == 2  # one generation each; the episode kept nothing and went no further
