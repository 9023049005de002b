"""The learner's HTTP API: ``GET /v1/status``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

LoopState = Literal["starting", "training", "finished", "failed", "stopped"]


class DroppedCounts(BaseModel):
    duplicate: int = Field(ge=0, description="groups whose group_id was already trained on")
    stale: int = Field(ge=0, description="groups older than max_staleness versions")
    foreign: int = Field(
        default=0, ge=0, description="groups of tasks this run never admitted (trained on or dropped)"
    )


class PublishStatus(BaseModel):
    version: int
    path: str
    updated: list[str] = Field(description="engine URLs that loaded this version")
    stale: dict[str, str] = Field(description="engine URL -> why its update failed")
    seconds: float = Field(description="broadcast + export + every engine's update")
    paths: dict[str, str] = Field(
        default_factory=dict, description="engine URL -> how it got the version: broadcast | disk"
    )


class LearnerStatus(BaseModel):
    state: LoopState
    step: int = Field(ge=0, description="optimizer steps taken (across restarts)")
    version: int = Field(ge=0, description="policy version (the last published weights)")
    admitted: int = Field(ge=0, description="tasks fed to the rollout")
    consumed: int = Field(ge=0, description="groups trained on")
    dropped: DroppedCounts
    in_flight: int = Field(ge=0, description="tasks admitted and neither trained on nor dropped")
    capacity: int = Field(
        ge=1, description="the in-flight bound, (max_staleness + 1) * batch_groups"
    )
    last_publish: PublishStatus | None = None
    last_metrics: dict[str, float | None] | None = Field(
        default=None, description="the last metrics.jsonl line's figures"
    )
    error: str | None = Field(default=None, description="why the loop stopped, when it failed")
