"""Shared fixtures: a real redis-server, the tiny model, the world, local BM25 search."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mempo.bm25 import LocalSearch
from mempo.keys import Keys
from mempo.procs import RedisServer
from mempo_sim.world import World, WorldConfig

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("MEMPO_TEST_CACHE", REPO / ".cache" / "tests"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def keys() -> Keys:
    """A fresh key prefix per test, so tests sharing the server never see each other."""
    return Keys(prefix=f"test-{uuid.uuid4().hex[:8]}:")


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[object]:
    from mempo.queue import connect

    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The default tiny Qwen2 + tokenizer, built once and cached under .cache/tests."""
    from mempo_sim.tiny import ensure_tiny

    return ensure_tiny(CACHE)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def world() -> World:
    return World.generate(WorldConfig(seed=0))


@pytest.fixture(scope="session")
def local_search(world: World) -> LocalSearch:
    return LocalSearch(world.passages)
