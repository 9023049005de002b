"""The scorer refuses work by size before doing it, drops the rest of a request whose
client left, and strings that are not valid Unicode (a lone surrogate, which JSON can
spell) are 422s naming the field, never 500s."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx
import pytest
import uvicorn

from mempo.api.scorer import ScoreItem
from mempo.procs import free_port
from mempo_sim.world import World
from services.scorer.app import create_app
from services.scorer.model import LoadedModel
from services.scorer.plan import Plan, RowTooLong, plan_item, plan_memory
from services.scorer.settings import ScorerSettings

from .conftest import AppClient, random_trajectory

TRAJECTORY: dict[str, Any] = {
    "questions": ["Where was Bothi born?"],
    "answers": [["Dostania"]],
    "rounds": [{"memory": "Q1: ?", "transcript": "<mem>Q1: ?</mem>\n<search>Bothi</search>"}],
}
ITEM: dict[str, Any] = {"context": "Bothi was born in", "answers": ["Dostania"]}

# JSON spelled by hand: json.dumps would refuse to write a lone surrogate into a body
SURROGATES: list[tuple[str, str, str]] = [
    ("/v1/score", '{"items": [{"context": "a\\ud800", "answers": ["x"]}]}', "items.0.context"),
    (
        "/v1/score",
        '{"items": [{"context": [{"role": "user", "content": "\\udc00"}], "answers": ["x"]}]}',
        "items.0.context",
    ),
    ("/v1/score", '{"items": [{"context": "ok", "answers": ["\\ud83d"]}]}', "items.0.answers.0"),
    (
        "/v1/memory-scores",
        '{"questions": ["q\\ud800"], "answers": [["a"]], '
        '"rounds": [{"memory": null, "transcript": "t"}]}',
        "trajectories.0.questions.0",
    ),
    (
        "/v1/memory-scores",
        '{"questions": ["q"], "answers": [["a"]], '
        '"rounds": [{"memory": "\\udfff", "transcript": "t"}]}',
        "trajectories.0.rounds.0.memory",
    ),
    (
        "/v1/memory-scores",
        '{"trajectories": [{"questions": ["q"], "answers": [["a\\ud800"]], '
        '"rounds": [{"memory": null, "transcript": "t\\ud800"}]}]}',
        "trajectories.0.answers.0.0",
    ),
]


@pytest.mark.parametrize(("path", "raw", "field"), SURROGATES)
async def test_lone_surrogates_are_422_naming_the_field(
    app_client: AppClient, path: str, raw: str, field: str
) -> None:
    async with app_client() as client:
        resp = await client.post(path, content=raw, headers={"content-type": "application/json"})
        assert resp.status_code == 422, resp.text
        assert field in resp.json()["message"] and "surrogate" in resp.json()["message"]
        # a valid surrogate pair (an emoji, as json.dumps escapes it) is fine
        pair = '{"items": [{"context": "smile \\ud83d\\ude00", "answers": ["x"]}]}'
        ok = await client.post("/v1/score", content=pair, headers={"content-type": "application/json"})
        assert ok.status_code == 200, ok.text


async def test_text_over_the_byte_limits_is_refused_before_tokenising(
    app_client: AppClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with app_client(max_sequence_tokens=64, max_request_tokens=256) as client:
        scorer = client.app.state.scorer  # type: ignore[attr-defined]
        planned: list[str] = []
        def counted(name: str) -> Any:
            original = getattr(scorer, name)

            def plan(request: Any) -> Any:
                planned.append(name)
                return original(request)

            return plan

        for name in ("plan_memory_request", "plan_score_request"):
            monkeypatch.setattr(scorer, name, counted(name))
        long_round = {"memory": "m", "transcript": "x" * (64 * 16)}  # 16 bytes a token
        one = {**TRAJECTORY, "rounds": [long_round]}
        resp = await client.post("/v1/memory-scores", json=one)
        assert resp.status_code == 413, resp.text
        assert resp.json()["message"].startswith("trajectories.0:") and "bytes" in resp.json()["message"]
        items = {"items": [{"context": "\u00e9" * 600, "answers": ["x"]}]}  # 1200 bytes > 1024
        resp = await client.post("/v1/score", json=items)
        assert resp.status_code == 413 and "items.0" in resp.json()["message"]
        many = {"items": [{"context": "y" * 900, "answers": ["x"]}] * 5}  # 4500 > 256 x 16
        resp = await client.post("/v1/score", json=many)
        assert resp.status_code == 413 and "request limit" in resp.json()["message"]
        assert planned == []  # none of them was tokenised
        assert (await client.post("/v1/score", json={"items": [ITEM]})).status_code == 200
        assert planned == ["plan_score_request"]


async def test_the_byte_cap_follows_the_model_positions_below_max_sequence_tokens(
    app_client: AppClient, loaded: LoadedModel
) -> None:
    """The limit applied is min(max_sequence_tokens, the model's positions): an item too
    long for the model is refused on its bytes, not after tokenising (11 s for 15 MB)."""
    positions = loaded.max_positions
    assert positions is not None and positions < 32768
    async with app_client(max_sequence_tokens=32768) as client:
        scorer = client.app.state.scorer  # type: ignore[attr-defined]
        item = {"context": "z" * (positions * 16 + 1), "answers": ["x"]}
        started = time.perf_counter()
        resp = await client.post("/v1/score", json={"items": [item]})
        assert resp.status_code == 413 and "bytes" in resp.json()["message"], resp.text
        assert str(positions * 16) in resp.json()["message"]
        assert time.perf_counter() - started < 1.0 and scorer.holder.current is not None


def count_encoded(monkeypatch: pytest.MonkeyPatch, loaded: LoadedModel) -> list[int]:
    """Wraps the model's tokenizer: the characters of every text it is asked to encode."""
    tok = loaded.tokenizer
    original = tok.encode
    encoded: list[int] = []

    def encode(text: str, *args: Any, **kwargs: Any) -> Any:
        encoded.append(len(text))
        return original(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)
    return encoded


async def test_items_within_the_byte_cap_are_refused_at_the_first_over_the_token_limit(
    app_client: AppClient, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack: many items each just under the per-item byte cap (positions x 16) but
    over the token limit. The 413 comes after tokenising the first one, not all of them
    (120 such items took 9-11 s before; 4 at once 53 s each and 900 MiB kept)."""
    positions = loaded.max_positions
    assert positions is not None
    size = positions * 16 - 72  # 131,000 bytes for 8k positions: under the byte cap
    n = 32
    items = [{"context": "x" * size, "answers": [f"a{i}"]} for i in range(n)]
    body = json.dumps({"items": items}).encode()
    tok = loaded.tokenizer
    started = time.perf_counter()
    for item in items:  # what the old code did before refusing
        tok.encode(item["context"], add_special_tokens=False)
    tokenise_all = time.perf_counter() - started
    async with app_client() as client:
        encoded = count_encoded(monkeypatch, loaded)
        started = time.perf_counter()
        resp = await client.post(
            "/v1/score", content=body, headers={"content-type": "application/json"}
        )
        refused = time.perf_counter() - started
        assert resp.status_code == 413, resp.text
        message = resp.json()["message"]
        assert message.startswith("items.0:") and "max_sequence_tokens" in message
        assert str(positions) in message
        assert encoded == [size]  # the first context only: not its alias, no other item
        assert refused < tokenise_all / 4, (refused, tokenise_all)
        # the same items within the limit are scored
        ok = {"items": [{"context": "x" * (positions // 4), "answers": ["a"]}] * 2}
        assert (await client.post("/v1/score", json=ok)).status_code == 200


async def test_an_item_further_on_is_refused_before_the_items_after_it(
    app_client: AppClient, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoded = count_encoded(monkeypatch, loaded)
    async with app_client(max_sequence_tokens=64) as client:
        short = {"context": "y" * 20, "answers": ["x"]}
        long = {"context": "y" * 1000, "answers": ["x"]}  # under 64 x 16 bytes, over 64 tokens
        resp = await client.post("/v1/score", json={"items": [short, short, long, *[long] * 50]})
        assert resp.status_code == 413, resp.text
        assert resp.json()["message"].startswith("items.2:")
        assert encoded.count(1000) == 1 and encoded.count(20) == 2  # none after items.2
    # the running total: the item that takes the request over max_request_tokens
    encoded.clear()
    async with app_client(max_sequence_tokens=64, max_request_tokens=2000) as client:
        fits = {"context": "y" * 60, "answers": ["x"]}  # 60+ tokens; 400 x 61 bytes < 2000 x 16
        resp = await client.post("/v1/score", json={"items": [fits] * 400})
        assert resp.status_code == 413, resp.text
        message = resp.json()["message"]
        assert message.startswith("items: ") and "max_request_tokens" in message
        crossed = int(message.split("up to items.")[1].split()[0])
        assert 20 < crossed < 40 and encoded.count(60) == crossed + 1  # none after it


async def test_a_trajectory_is_refused_while_it_is_planned(
    app_client: AppClient, loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds x aliases branches are not built past the limit: thousands of tiny rounds
    with many aliases fit the byte cap but would make millions of segments."""
    rounds = [{"memory": "m", "transcript": "t"}] * 3000
    trajectory = {
        "questions": ["q"],
        "answers": [[f"alias {i}" for i in range(100)]],
        "rounds": rounds,
    }
    async with app_client(max_sequence_tokens=2048) as client:
        encoded = count_encoded(monkeypatch, loaded)
        started = time.perf_counter()
        resp = await client.post("/v1/memory-scores", json=trajectory)
        assert resp.status_code == 413, resp.text
        message = resp.json()["message"]
        assert message.startswith("trajectories.0:") and "max_sequence_tokens" in message
        # the aliases, the cue and the prompt: no round (6000 texts), no branch built
        assert len(encoded) <= 100 + 2, len(encoded)
        assert time.perf_counter() - started < 5.0


def test_planning_refuses_exactly_the_rows_over_the_limit(
    loaded: LoadedModel, world: World
) -> None:
    """The running count is the row's: a row of n tokens plans under limit n, and is
    refused (RowTooLong, nothing added) under n - 1."""
    tok, rng = loaded.tokenizer, random.Random(3)
    for _ in range(12):
        trajectory = random_trajectory(rng, world, rng.randint(1, 6))
        whole = Plan()
        plan_memory(whole, tok, trajectory, "best")
        n = whole.rows[0].num_tokens
        plan_memory(Plan(), tok, trajectory, "best", limit=n)
        refused = Plan()
        with pytest.raises(RowTooLong):
            plan_memory(refused, tok, trajectory, "best", limit=n - 1)
        assert refused.rows == [] and refused.memory == []
    item = ScoreItem(context="Bothi was born in", answers=["Dostania", "Dost", "Dostania"])
    whole = Plan()
    plan_item(whole, tok, item, "best")
    n = whole.rows[0].num_tokens
    assert plan_item(Plan(), tok, item, "best", limit=n)
    refused = Plan()
    with pytest.raises(RowTooLong):
        plan_item(refused, tok, item, "best", limit=n - 1)
    assert refused.rows == [] and refused.items == []


async def test_entries_per_request_are_capped(app_client: AppClient) -> None:
    async with app_client(max_trajectories=3, max_items=2) as client:
        resp = await client.post("/v1/memory-scores", json={"trajectories": [TRAJECTORY] * 4})
        assert resp.status_code == 413 and "max_trajectories" in resp.json()["message"]
        resp = await client.post("/v1/score", json={"items": [ITEM] * 3})
        assert resp.status_code == 413 and "max_items" in resp.json()["message"]
        ok = await client.post("/v1/memory-scores", json={"trajectories": [TRAJECTORY] * 3})
        assert ok.status_code == 200 and len(ok.json()["results"]) == 3


async def test_the_token_limit_still_applies_within_the_byte_limit(app_client: AppClient) -> None:
    async with app_client(max_sequence_tokens=64, max_text_bytes_per_token=1000.0) as client:
        long_round = {"memory": "m", "transcript": "word " * 200}
        resp = await client.post("/v1/memory-scores", json={**TRAJECTORY, "rounds": [long_round]})
        assert resp.status_code == 413 and "tokens" in resp.json()["message"]


async def test_a_client_that_leaves_has_the_rest_of_its_rows_dropped(loaded: LoadedModel) -> None:
    settings = ScorerSettings(max_wait_ms=1.0, max_batch_tokens=256)
    app = create_app(settings, loaded=loaded)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    served = asyncio.create_task(server.serve())
    batches: list[int] = []
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        batcher = app.state.scorer.batcher
        real = batcher.run_rows

        def slow(rows: Any) -> Any:
            batches.append(len(rows))
            time.sleep(0.2)
            return real(rows)

        batcher.run_rows = slow
        body = {"trajectories": [TRAJECTORY] * 100}  # a few rows a batch: 20+ batches
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/memory-scores", json=body, timeout=httpx.Timeout(10, read=0.3))
        await asyncio.sleep(1.5)
        seen = len(batches)
        await asyncio.sleep(0.6)
        assert len(batches) == seen and sum(batches) < 60, batches  # it stopped early
    finally:
        server.should_exit = True
        await asyncio.wait_for(served, 30)
