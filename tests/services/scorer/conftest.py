"""Scorer fixtures: the tiny model loaded once, a perturbed copy under a weights root,
random trajectories, and an in-process app client (lifespan included)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from mempo import agent_format as fmt
from mempo.api.scorer import MemoryRound, MemoryTrajectory
from mempo_sim.world import World
from services.scorer.app import create_app
from services.scorer.model import LoadedModel, load_model
from services.scorer.settings import ScorerSettings


@pytest.fixture(scope="session")
def loaded(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir, "0", device="cpu")


@pytest.fixture(scope="session")
def weights_root(tmp_path_factory: pytest.TempPathFactory, loaded: LoadedModel) -> Path:
    """A weights root holding v1/: the tiny model with perturbed weights."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("weights")
    model = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    model.save_pretrained(root / "v1")
    loaded.tokenizer.save_pretrained(root / "v1")
    return root


def random_trajectory(rng: random.Random, world: World, rounds: int) -> MemoryTrajectory:
    """k questions with 1-3 aliases each, transcripts cut from the world's passages."""
    k = rng.randint(1, 3)
    questions = [rng.choice(world.questions).text for _ in range(k)]
    answers = [
        [rng.choice(world.passages)["contents"].split("\n")[0] for _ in range(rng.randint(1, 3))]
        for _ in range(k)
    ]
    out = []
    for _ in range(rounds):
        words = rng.choice(world.passages)["contents"].split()
        memory = " ".join(rng.sample(words, min(len(words), rng.randint(1, 12))))
        response = f"<mem>{memory}</mem>\n<think>go on</think>\n<search>{words[0]}</search>"
        information = " ".join(words[: rng.randint(5, 120)])
        out.append(
            MemoryRound(
                memory=memory if rng.random() > 0.2 else None,
                transcript=fmt.round_transcript(response, information),
            )
        )
    return MemoryTrajectory(questions=questions, answers=answers, rounds=out)


AppClient = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@pytest.fixture
def app_client(loaded: LoadedModel) -> AppClient:
    """``async with app_client(**settings) as client`` runs the app's lifespan around it.
    Admin routes are open unless the test sets an admin token (auth has its own tests)."""

    @asynccontextmanager
    async def make(**overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
        settings = ScorerSettings(**{"max_wait_ms": 1.0, "admin_open": True, **overrides})
        app = create_app(settings, loaded=loaded)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://scorer") as client:
                client.app = app  # type: ignore[attr-defined]
                yield client

    return make
