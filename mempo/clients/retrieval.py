"""Client of the retrieval service (or Search-R1's own server: same contract)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from mempo.agent_format import format_documents
from mempo.api.retrieval import RetrievalInfo
from mempo.retry import Backoff, request


class RetrievalError(Exception):
    pass


class RetrievalClient:
    def __init__(
        self,
        url: str,
        topk: int = 3,
        timeout_s: float = 30.0,
        attempts: int = 4,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        """``url`` is the service's base URL or its full ``.../retrieve`` URL."""
        base = url.rstrip("/")
        self.url = base if base.endswith("/retrieve") else f"{base}/retrieve"
        self.topk = topk
        self.attempts = attempts
        self._own_client = client is None
        self.http = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def aclose(self) -> None:
        if self._own_client:
            await self.http.aclose()

    async def retrieve(
        self, queries: Sequence[str], topk: int | None = None
    ) -> list[list[dict[str, Any]]]:
        """Per query, ``[{"document": {"id", "contents"}, "score"}]`` best first."""
        body = {"queries": list(queries), "topk": topk or self.topk, "return_scores": True}
        response = await request(
            self.http,
            "POST",
            self.url,
            json=body,
            attempts=self.attempts,
            backoff=Backoff(base=0.2, cap=5.0),
        )
        if response.status_code >= 400:
            raise RetrievalError(f"retrieval: HTTP {response.status_code}: {response.text[:300]}")
        result = response.json().get("result")
        if not isinstance(result, list) or len(result) != len(queries):
            raise RetrievalError("retrieval: the response has no result list per query")
        return result

    async def info(self) -> RetrievalInfo:
        """The service's ``GET /v1/info`` (ours only: Search-R1's server has no such route)."""
        url = self.url.removesuffix("/retrieve") + "/v1/info"
        response = await request(
            self.http, "GET", url, attempts=self.attempts, backoff=Backoff(base=0.2, cap=5.0)
        )
        if response.status_code >= 400:
            raise RetrievalError(f"retrieval: HTTP {response.status_code}: {response.text[:300]}")
        return RetrievalInfo.model_validate(response.json())

    async def search(self, query: str, topk: int | None = None) -> str:
        """One query, formatted as the body of the <information> block (Search-R1 style)."""
        return format_documents((await self.retrieve([query], topk))[0])
