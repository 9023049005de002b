"""The typed clients over one base (mempo/clients/base.py): a refusal and a 5xx that
outlasts the retries are the service's own error with its status; answers are models."""

from __future__ import annotations

import httpx
import pytest

from mempo.api.retrieval import ScoredDocument
from mempo.api.scorer import ScoreItem
from mempo.clients.base import RemoteError
from mempo.clients.engine import ContextExceeded, EngineClient, EngineError
from mempo.clients.retrieval import RetrievalClient, RetrievalError
from mempo.clients.scorer import ScorerClient, ScorerError


def http(status: int, body: object, calls: list[str]) -> httpx.AsyncClient:
    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(status, json=body)

    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


@pytest.mark.parametrize("status", [400, 503])
async def test_every_client_raises_its_own_error_with_the_status(status: int) -> None:
    calls: list[str] = []
    body = {"message": "no"}
    scorer = ScorerClient("http://s", attempts=2, client=http(status, body, calls))
    retrieval = RetrievalClient("http://r/retrieve", attempts=2, client=http(status, body, calls))
    engine = EngineClient(
        "http://e", attempts=2, backoff_base_s=0.0, client=http(status, body, calls)
    )
    scorer.backoff = retrieval.backoff = engine.backoff
    cases = [
        (ScorerError, scorer.score([ScoreItem(context="c", answers=["a"])])),
        (RetrievalError, retrieval.retrieve(["q"])),
        (EngineError, engine.model_info()),
    ]
    for error, call in cases:
        with pytest.raises(error) as raised:
            await call
        assert isinstance(raised.value, RemoteError) and raised.value.status_code == status
    assert len(calls) == (3 if status == 400 else 6)  # a 4xx once; a 503 each attempt


async def test_the_engine_names_a_prompt_too_long_for_its_context() -> None:
    body = {
        "error": {"message": "The input (9000 tokens) is longer than the model's context length"}
    }
    engine = EngineClient("http://e", client=http(400, body, []))
    with pytest.raises(ContextExceeded, match="context length"):
        await engine.generate([1, 2], {"max_new_tokens": 4})


async def test_retrieval_answers_scored_documents_and_refuses_a_short_result() -> None:
    hit = {"document": {"id": "7", "contents": '"T"\nbody'}, "score": 1.5}
    client = RetrievalClient("http://r", client=http(200, {"result": [[hit]]}, []))
    assert await client.retrieve(["q"]) == [[ScoredDocument.model_validate(hit)]]
    assert await client.search("q") == 'Doc 1(Title: "T") body'
    with pytest.raises(RetrievalError, match="per query"):
        await client.retrieve(["q", "r"])
    broken = RetrievalClient("http://r", client=http(200, {"result": "nope"}, []))
    with pytest.raises(RetrievalError, match="unreadable"):
        await broken.retrieve(["q"])
