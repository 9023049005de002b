"""Rollout worker API: run one task now, and the worker's status.

The routes: docs/architecture.md, 'HTTP routes', and docs/rollout.md.

``POST /v1/episodes`` answers with the task's ``mempo.schemas.Group`` (the wire record
the learner trains on), so evaluation and other tools read exactly what training reads.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from mempo.schemas import Task


class EpisodesRequest(BaseModel):
    """Run the task's n episodes now on this worker's engine (nothing goes to Redis)."""

    model_config = ConfigDict(extra="forbid")

    task: Task
    score: bool = Field(
        default=True,
        description="memory mode: ask the scorer for every round's P_mem / P_full "
        "(ignored in full mode and when the worker has no scorer)",
    )


class WorkerStatus(BaseModel):
    """What the worker is doing; counters are since start."""

    worker_id: str
    ready: bool
    reason: str | None = Field(default=None, description="why the worker is not ready")
    consuming: bool = Field(description="the Redis consumer loop is running")
    engine_url: str
    engine_weight_version: str | None = Field(
        default=None, description="the engine's weight_version when last read"
    )
    policy_version: int | None = Field(default=None, description="mempo:policy when last read")
    max_context_tokens: int | None = None
    in_flight_tasks: int = 0
    in_flight_episodes: int = 0
    tasks_done: int = 0
    tasks_failed: int = 0
    episodes: int = 0
    rounds: int = 0
    tokens: int = Field(default=0, description="prompt + response tokens the engine processed")
