"""The learner's HTTP app: /health, /ready, /metrics and GET /v1/status."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from mempo.api.learner import LearnerStatus
from mempo.service import NotReady, install_common
from services.learner.runner import LearnerRunner
from services.learner.settings import LearnerSettings
from services.learner.telemetry import LearnerMetrics


def get_runner(request: Request) -> LearnerRunner:
    runner: LearnerRunner | None = getattr(request.app.state, "runner", None)
    if runner is None:
        raise NotReady("the learner is starting")
    return runner


RunnerDep = Annotated[LearnerRunner, Depends(get_runner)]


def create_app(settings: LearnerSettings | None = None) -> FastAPI:
    settings = settings or LearnerSettings()
    metrics = LearnerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner = LearnerRunner(settings, metrics)
        app.state.runner = runner
        runner.start()
        try:
            yield
        finally:
            await runner.stop()

    app = FastAPI(title="MemPO learner", version="1", lifespan=lifespan)

    async def ready() -> tuple[bool, str | None]:
        runner: LearnerRunner | None = getattr(app.state, "runner", None)
        return (False, "starting") if runner is None else await runner.ready()

    install_common(app, "learner", metrics, ready, settings)

    @app.get("/v1/status", response_model=LearnerStatus, tags=["learner"])
    async def status(runner: RunnerDep) -> LearnerStatus:
        """Step, version, tasks admitted, groups consumed and dropped, the last metrics."""
        return await runner.status()

    return app
