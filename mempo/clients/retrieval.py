"""Client of the retrieval service (or Search-R1's own server: same contract)."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
from pydantic import ValidationError

from mempo.agent_format import format_documents
from mempo.api.retrieval import RetrievalInfo, RetrieveResponse, ScoredDocument
from mempo.clients.base import RemoteError, ServiceClient
from mempo.retry import Backoff


class RetrievalError(RemoteError):
    pass


class RetrievalClient(ServiceClient):
    error = RetrievalError

    def __init__(
        self,
        url: str,
        topk: int = 3,
        timeout_s: float = 30.0,
        attempts: int = 4,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        """``url`` is the service's base URL or its full ``.../retrieve`` URL."""
        super().__init__(
            url.rstrip("/").removesuffix("/retrieve"),
            timeout_s=timeout_s,
            attempts=attempts,
            backoff=Backoff(base=0.2, cap=5.0),
            client=client,
        )
        self.topk = topk

    def _error(self, path: str, response: httpx.Response) -> RemoteError:
        return RetrievalError(
            f"retrieval: HTTP {response.status_code}: {response.text[:300]}", response.status_code
        )

    async def retrieve(
        self, queries: Sequence[str], topk: int | None = None
    ) -> list[list[ScoredDocument]]:
        """Per query, its documents with their scores, best first."""
        body = {"queries": list(queries), "topk": topk or self.topk, "return_scores": True}
        response = await self._call("POST", "/retrieve", json=body)
        try:
            result = RetrieveResponse.model_validate_json(response.content).result
        except ValidationError as exc:
            raise RetrievalError(f"retrieval: unreadable response: {str(exc)[:300]}") from exc
        if len(result) != len(queries) or not all(
            isinstance(doc, ScoredDocument) for hits in result for doc in hits
        ):
            raise RetrievalError("retrieval: the response has no scored result list per query")
        return result  # type: ignore[return-value]

    async def info(self) -> RetrievalInfo:
        """The service's ``GET /v1/info`` (ours only: Search-R1's server has no such route)."""
        return RetrievalInfo.model_validate((await self._call("GET", "/v1/info")).json())

    async def search(self, query: str, topk: int | None = None) -> str:
        """One query, formatted as the body of the <information> block (Search-R1 style)."""
        hits = (await self.retrieve([query], topk))[0]
        return format_documents([hit.model_dump() for hit in hits])
