"""Client of the scorer service: P_mem / P_full per round, and generic answer scores."""

from __future__ import annotations

from collections.abc import Sequence

import httpx

from mempo.api.scorer import (
    AliasPolicy,
    MemoryScoresRequest,
    MemoryScoresResponse,
    MemoryTrajectory,
    ScoreItem,
    ScoreRequest,
    ScoreResponse,
)
from mempo.retry import Backoff, request


class ScorerError(Exception):
    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class ScorerClient:
    def __init__(
        self,
        base_url: str,
        timeout_s: float = 300.0,
        attempts: int = 5,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.attempts = attempts
        self._own_client = client is None
        self.http = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def aclose(self) -> None:
        if self._own_client:
            await self.http.aclose()

    async def _post(self, path: str, body: str) -> str:
        response = await request(
            self.http,
            "POST",
            f"{self.base_url}{path}",
            content=body,
            headers={"content-type": "application/json"},
            attempts=self.attempts,
            backoff=Backoff(base=0.5, cap=10.0),
        )
        if response.status_code >= 400:
            raise ScorerError(
                f"{path}: HTTP {response.status_code}: {response.text[:300]}", response.status_code
            )
        return response.text

    async def memory_scores(
        self, trajectories: Sequence[MemoryTrajectory], alias_policy: AliasPolicy = "best"
    ) -> MemoryScoresResponse:
        req = MemoryScoresRequest(trajectories=list(trajectories), alias_policy=alias_policy)
        return MemoryScoresResponse.model_validate_json(
            await self._post("/v1/memory-scores", req.model_dump_json())
        )

    async def score(
        self, items: Sequence[ScoreItem], alias_policy: AliasPolicy = "best"
    ) -> ScoreResponse:
        req = ScoreRequest(items=list(items), alias_policy=alias_policy)
        return ScoreResponse.model_validate_json(
            await self._post("/v1/score", req.model_dump_json())
        )
