"""A scripted engine, retriever and scorer with no model: for tests, benchmarks and demos.

``scripted_reply`` answers a ``/generate`` the way SGLang does (``output_ids`` keep the
stop string, ``text`` has it trimmed, ``finish_reason`` names what matched, an EOS is
appended when no stop string ended the text, ``max_new_tokens`` truncates with
``{"type": "length"}``), with fake log-probs. ``ScriptedUpstreams`` serves the routes the
worker calls (engine, retrieval, scorer) as one ``httpx.MockTransport`` handler, so the
worker's real clients run against it with zero network latency; the script is usually
the world's oracle (mempo_sim/oracle.py) reading the decoded prompt.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from mempo.agent_format import Tokenizer
from mempo.bm25 import LocalSearch
from mempo.clients.engine import EngineClient
from mempo.clients.retrieval import RetrievalClient
from mempo.clients.scorer import ScorerClient
from services.rollout.upstreams import Upstreams

Script = Callable[[str], str]  # decoded prompt -> response text


def fake_logprob(token_id: int) -> float:
    return -0.05 - (token_id % 13) / 10.0


def scripted_reply(
    tok: Tokenizer,
    text: str,
    input_ids: list[int],
    params: dict[str, Any],
    weight_version: str = "0",
) -> dict[str, Any]:
    """SGLang's /generate response for a model that would have written ``text``."""
    max_new = int(params.get("max_new_tokens", 128))
    ids = list(tok.encode(text, add_special_tokens=False))
    stop: str | None = next((s for s in params.get("stop") or [] if text.endswith(s)), None)
    matched: int | str
    if stop is not None:
        text, matched = text[: -len(stop)], stop  # SGLang trims the stop string; ids keep it
    else:
        matched = int(getattr(tok, "eos_token_id", 0) or 0)
        ids.append(matched)
    finish: dict[str, Any] = {"type": "stop", "matched": matched}
    if len(ids) > max_new:
        ids = ids[:max_new]
        text = tok.decode(ids, skip_special_tokens=True)
        finish = {"type": "length", "length": max_new}
    return {
        "text": text,
        "output_ids": ids,
        "meta_info": {
            "id": "scripted",
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": 0,
            "weight_version": weight_version,
            "output_token_logprobs": [[fake_logprob(t), t, None] for t in ids],
            "input_token_logprobs": [],
        },
    }


class ScriptedUpstreams:
    """Engine (/generate, /model_info, /server_info), retrieval (/retrieve) and scorer
    (/v1/memory-scores: P_mem 0.5, P_full 0.25) behind one MockTransport handler.

    ``busy_s`` adds up the time spent inside the handler, so a benchmark can subtract
    what the stand-ins cost from what the worker costs."""

    def __init__(
        self,
        tok: Tokenizer,
        script: Script,
        search: LocalSearch,
        context_length: int = 1 << 20,
        model_path: str = "scripted",
    ) -> None:
        self.tok = tok
        self.script = script
        self.search = search
        self.context_length = context_length
        self.model_path = model_path
        self.busy_s = 0.0
        self.generations = 0
        self.on_generate: Callable[[], None] | None = None

    async def handler(self, request: httpx.Request) -> httpx.Response:
        """Zero latency, but it yields to the event loop once, as a network call would."""
        await asyncio.sleep(0)
        started = time.perf_counter()
        try:
            return httpx.Response(200, json=self._route(request.url.path, request))
        finally:
            self.busy_s += time.perf_counter() - started

    def _route(self, path: str, request: httpx.Request) -> Any:
        if path == "/generate":
            body = json.loads(request.content)
            self.generations += 1
            if self.on_generate is not None:
                self.on_generate()
            prompt = self.tok.decode(body["input_ids"], skip_special_tokens=True)
            return scripted_reply(self.tok, self.script(prompt), body["input_ids"], body["sampling_params"])
        if path == "/retrieve":
            body = json.loads(request.content)
            return {"result": self.search.retrieve(body["queries"], body.get("topk") or 3)}
        if path == "/v1/memory-scores":
            body = json.loads(request.content)
            return {"results": [_scores(t["rounds"]) for t in body["trajectories"]], "weight_version": "0"}
        if path == "/model_info":
            return {"model_path": self.model_path, "tokenizer_path": self.model_path, "weight_version": "0"}
        if path == "/server_info":
            return {"context_length": self.context_length}
        raise ValueError(f"the scripted upstreams have no route {path}")

    def upstreams(self, with_scorer: bool = True) -> Upstreams:
        def client() -> httpx.AsyncClient:
            return httpx.AsyncClient(transport=httpx.MockTransport(self.handler))

        return Upstreams(
            engine=EngineClient("http://engine", client=client()),
            retrieval=RetrievalClient("http://retrieval", client=client()),
            scorer=ScorerClient("http://scorer", client=client()) if with_scorer else None,
        )


def _scores(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "rounds": [
            {
                "index": i,
                "p_mem": None if r["memory"] is None else 0.5,
                "p_full": 0.25,
                "reward": None if r["memory"] is None else 0.25,
                "mem_context_tokens": None,
                "full_context_tokens": 0,
            }
            for i, r in enumerate(rounds)
        ],
        "candidates": [],
    }
