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
from mempo.clients.base import RemoteError, ServiceClient
from mempo.retry import Backoff


class ScorerError(RemoteError):
    pass


class ScorerClient(ServiceClient):
    error = ScorerError

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 300.0,
        attempts: int = 5,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(
            base_url,
            timeout_s=timeout_s,
            attempts=attempts,
            backoff=Backoff(base=0.5, cap=10.0),
            client=client,
        )

    async def _post(self, path: str, body: str) -> str:
        response = await self._call(
            "POST", path, content=body, headers={"content-type": "application/json"}
        )
        return response.text

    async def memory_scores(
        self,
        trajectories: Sequence[MemoryTrajectory],
        alias_policy: AliasPolicy = "best",
        task_score: bool = False,
    ) -> MemoryScoresResponse:
        """P_mem / P_full per round; with ``task_score`` also each trajectory's P_task."""
        req = MemoryScoresRequest(
            trajectories=list(trajectories), alias_policy=alias_policy, task_score=task_score
        )
        # task_score goes out only when true: a scorer older than it refuses unknown fields
        body = req.model_dump_json(exclude=None if task_score else {"task_score"})
        return MemoryScoresResponse.model_validate_json(await self._post("/v1/memory-scores", body))

    async def score(
        self, items: Sequence[ScoreItem], alias_policy: AliasPolicy = "best"
    ) -> ScoreResponse:
        req = ScoreRequest(items=list(items), alias_policy=alias_policy)
        return ScoreResponse.model_validate_json(
            await self._post("/v1/score", req.model_dump_json())
        )
