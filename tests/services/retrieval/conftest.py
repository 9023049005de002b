"""Fixtures of the retrieval tests: corpus files, the ASGI app with its lifespan, the encoder."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import httpx
import pytest

from mempo_sim.world import World
from services.retrieval.app import create_app
from services.retrieval.settings import RetrievalSettings

Serve = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


def write_corpus(
    path: Path, passages: list[dict[str, str]], broken: dict[int, str] | None = None
) -> Path:
    """A wiki-18 style jsonl file; ``broken`` inserts raw lines before the given positions."""
    broken = broken or {}
    with path.open("w", encoding="utf-8") as handle:
        for i, passage in enumerate(passages):
            if i in broken:
                handle.write(broken[i] + "\n")
            handle.write(json.dumps(passage) + "\n")
    return path


@pytest.fixture(scope="session")
def world_corpus(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "world.jsonl", world.passages)


async def wait_ready(client: httpx.AsyncClient, timeout_s: float = 60.0) -> httpx.Response:
    """Poll /ready until it is 200 or says why it never will be."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        response = await client.get("/ready")
        reason = response.json().get("reason") or ""
        if response.status_code == 200 or "failed" in reason or loop.time() > deadline:
            return response
        await asyncio.sleep(0.02)


@pytest.fixture
def serve() -> Serve:
    """``async with serve(**settings) as client``: the app, started and ready, over ASGI."""

    @asynccontextmanager
    async def serving(**fields: object) -> AsyncIterator[httpx.AsyncClient]:
        app = create_app(RetrievalSettings(**fields))  # type: ignore[arg-type]
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://retrieval"
            ) as client:
                await wait_ready(client)
                yield client

    return serving


@pytest.fixture
async def client(serve: Serve) -> AsyncIterator[httpx.AsyncClient]:
    """The zero-configuration service: BM25 over the built-in world (seed 0)."""
    async with serve() as ready_client:
        yield ready_client


@pytest.fixture(scope="session")
def encoder() -> object:
    """The offline all-MiniLM-L6-v2 (loaded once: dense tests share it)."""
    from services.retrieval.dense import Encoder

    return Encoder()
