"""What the worker talks to, and what it learns from its engine at start-up."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from mempo.agent_format import Tokenizer
from mempo.clients.engine import EngineClient
from mempo.clients.retrieval import RetrievalClient
from mempo.clients.scorer import ScorerClient
from services.rollout.settings import WorkerSettings

log = logging.getLogger(__name__)

FALLBACK_CONTEXT = 32768


@dataclass
class Upstreams:
    """The engine, retrieval and (optional) scorer clients of one worker."""

    engine: EngineClient
    retrieval: RetrievalClient
    scorer: ScorerClient | None

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> Upstreams:
        return cls(
            engine=EngineClient(
                settings.engine_url,
                admin_token=settings.engine_admin_token_value(),
                timeout_s=settings.engine_timeout_s,
            ),
            retrieval=RetrievalClient(settings.retrieval_url, topk=settings.retrieval_topk),
            scorer=(
                ScorerClient(settings.scorer_url, attempts=settings.scorer_attempts)
                if settings.scorer_url
                else None
            ),
        )

    async def aclose(self) -> None:
        await self.engine.aclose()
        await self.retrieval.aclose()
        if self.scorer is not None:
            await self.scorer.aclose()


async def load_tokenizer(engine: EngineClient, path: str | None) -> Tokenizer:
    """The tokenizer of ``path``, or of the engine's model (its /model_info)."""
    if not path:
        info = await engine.model_info()
        path = info.tokenizer_path or info.model_path
    log.info("loading the tokenizer from %s", path)
    return await asyncio.to_thread(_auto_tokenizer, path)


def _auto_tokenizer(path: str) -> Tokenizer:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)  # type: ignore[no-any-return,return-value]


async def context_length(engine: EngineClient) -> int:
    """The engine's context: CPU engine ``context_length``; SGLang ``context_length`` when set
    on its command line, else ``max_req_input_len + 1`` from the scheduler info."""
    info = await engine.server_info()
    sources: list[dict[str, Any]] = [info]
    states = info.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        sources.append(states[0])
    for source in sources:
        for key, extra in (("context_length", 0), ("max_req_len", 0), ("max_req_input_len", 1)):
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value + extra
    log.warning("the engine reports no context length; assuming %d tokens", FALLBACK_CONTEXT)
    return FALLBACK_CONTEXT
