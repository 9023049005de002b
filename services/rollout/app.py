"""The rollout worker's HTTP API; the consumer loop runs in the app's lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Annotated, TypeVar

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request

from mempo.agent_format import Tokenizer
from mempo.api.engine import (
    ContinueRequest,
    ControlResponse,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PauseRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsResponse,
)
from mempo.api.rollout import EpisodesRequest, WorkerStatus
from mempo.clients.engine import EngineError
from mempo.clients.retrieval import RetrievalError
from mempo.clients.scorer import ScorerError
from mempo.disconnects import cancel_on_disconnect
from mempo.queue import RedisQueue, connect
from mempo.retry import RetryableStatus
from mempo.schemas import Group
from mempo.service import (
    AdminDep,
    BadInput,
    ErrorBody,
    Metrics,
    NotReady,
    ServiceError,
    TooLarge,
    Upstream,
    install_common,
)
from services.rollout.group import ScoringFailed
from services.rollout.metrics import WorkerMetrics
from services.rollout.settings import WorkerSettings
from services.rollout.upstreams import Upstreams
from services.rollout.worker import NotBooted, RolloutWorker

UPSTREAM_ERRORS = (
    EngineError,
    RetrievalError,
    ScorerError,
    ScoringFailed,
    RetryableStatus,  # 5xx / 429 after the client's retries
    httpx.HTTPError,
)


class EngineAnswer(ServiceError):
    """The engine's own refusal of a forwarded call, with its status; a refused engine key
    is 502 (the worker's configuration is wrong, not the caller's token)."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


T = TypeVar("T")


async def _to_engine(call: Awaitable[T]) -> T:
    """A call forwarded to this replica's engine: the engine's 4xx passed on, a refused
    engine key or an engine that cannot be reached is 502."""
    try:
        return await call
    except EngineError as exc:
        code = exc.status_code or 502
        refused_key = code == 401 or (code == 403 and "token" in str(exc).lower())
        status = 502 if code >= 500 or refused_key else code
        raise EngineAnswer(f"the engine: {exc}", status) from exc
    except httpx.HTTPError as exc:
        raise Upstream(f"the engine: {type(exc).__name__}: {exc}") from exc


def get_worker(request: Request) -> RolloutWorker:
    return request.app.state.worker  # type: ignore[no-any-return]


WorkerDep = Annotated[RolloutWorker, Depends(get_worker)]


router = APIRouter()  # declarative routes; the worker comes from app.state


@router.get("/v1/status", response_model=WorkerStatus, tags=["rollout"])
async def status(worker: WorkerDep) -> WorkerStatus:
    """What the worker is doing: readiness, versions, in-flight work, counters."""
    await worker.check_redis()
    return worker.status()


@router.post(
    "/update_weights_from_disk",
    response_model=UpdateWeightsResponse,
    tags=["admin"],
    responses={502: {"model": ErrorBody}},
)
async def update_weights_from_disk(
    body: UpdateWeightsFromDiskRequest, worker: WorkerDep, _: AdminDep
) -> UpdateWeightsResponse:
    """Load published weights into this replica's engine (the learner's weight push).

    The engine is not reachable from outside the replica; this route, guarded by the
    worker's own admin token, forwards to it with the engine's key. An engine's 4xx
    answer is passed on; an engine that cannot be reached is 502."""
    if body.weight_version is None:
        raise BadInput("weight_version: required (the worker tracks its engine's version)")
    engine = worker.upstreams.engine
    update = engine.update_weights_from_disk(
        body.model_path, body.weight_version, body.abort_all_requests
    )
    return await _to_engine(worker.update_engine(update, body.weight_version))


# The learner's weight broadcast (services/learner/broadcast.py), forwarded likewise:
# the engine joins the learner's group itself, its tensors never pass through here.
@router.post("/pause_generation", response_model=ControlResponse, tags=["admin"])
async def pause_generation(
    worker: WorkerDep, _: AdminDep, body: PauseRequest | None = None
) -> ControlResponse:
    """Pause this replica's engine (around a weight broadcast)."""
    mode = (body or PauseRequest()).mode
    await _to_engine(worker.upstreams.engine.pause_generation(mode))
    return ControlResponse(message="Generation paused successfully.")


@router.post("/continue_generation", response_model=ControlResponse, tags=["admin"])
async def continue_generation(
    worker: WorkerDep, _: AdminDep, body: ContinueRequest | None = None
) -> ControlResponse:
    await _to_engine(worker.upstreams.engine.continue_generation())
    return ControlResponse(message="Generation continued successfully.")


@router.post("/init_weights_update_group", response_model=UpdateWeightsResponse, tags=["admin"])
async def init_weights_update_group(
    body: InitWeightsUpdateGroupRequest, worker: WorkerDep, _: AdminDep
) -> UpdateWeightsResponse:
    """Have this replica's engine join the learner's weight group."""
    engine = worker.upstreams.engine
    return await _to_engine(engine.init_weights_update_group(**body.model_dump()))


@router.post(
    "/update_weights_from_distributed", response_model=UpdateWeightsResponse, tags=["admin"]
)
async def update_weights_from_distributed(
    body: UpdateWeightsFromDistributedRequest, worker: WorkerDep, _: AdminDep
) -> UpdateWeightsResponse:
    """The next bucket of a weight broadcast; its version is this replica's once loaded."""
    update = worker.upstreams.engine.update_weights_from_distributed(
        body.names, body.dtypes, body.shapes, body.weight_version, body.group_name,
        body.load_format,
    )  # fmt: skip
    return await _to_engine(worker.update_engine(update, body.weight_version))


@router.post("/destroy_weights_update_group", response_model=UpdateWeightsResponse, tags=["admin"])
async def destroy_weights_update_group(
    worker: WorkerDep, _: AdminDep, body: DestroyWeightsUpdateGroupRequest | None = None
) -> UpdateWeightsResponse:
    name = (body or DestroyWeightsUpdateGroupRequest()).group_name
    return await _to_engine(worker.upstreams.engine.destroy_weights_update_group(name))


@router.post(
    "/v1/episodes",
    response_model=Group,
    tags=["rollout"],
    responses={502: {"model": ErrorBody}, 503: {"model": ErrorBody}},
)
async def episodes(body: EpisodesRequest, worker: WorkerDep, request: Request) -> Group:
    """Run one task's n episodes now and return its Group (not published to Redis).
    task.n and task.max_rounds are capped (413 beyond); a client that disconnects
    cancels its episodes."""
    task = body.task
    for field, value, cap in (
        ("n", task.n, worker.settings.episodes_max_n),
        ("max_rounds", task.max_rounds, worker.settings.episodes_max_rounds),
    ):
        if value > cap:
            limit = f"the limit of {cap} (episodes_max_{field})"
            raise TooLarge(f"task.{field}: {value} exceeds {limit}")
    try:
        return await cancel_on_disconnect(request, worker.run_task(task, score=body.score))
    except NotBooted as exc:
        raise NotReady(f"the worker is not ready: {exc}") from exc
    except UPSTREAM_ERRORS as exc:
        raise Upstream(f"{type(exc).__name__}: {exc}") from exc


def create_app(
    settings: WorkerSettings | None = None,
    upstreams: Upstreams | None = None,
    tokenizer: Tokenizer | None = None,
) -> FastAPI:
    """``upstreams`` / ``tokenizer`` default to the ones the settings point at."""
    settings = settings or WorkerSettings()
    metrics = WorkerMetrics(Metrics("rollout"))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        clients = upstreams or Upstreams.from_settings(settings)
        redis = (
            connect(settings.redis_url, settings.redis_password_value())
            if settings.redis_url
            else None
        )
        queue = (
            RedisQueue(
                redis,
                settings.keys(),
                consumer=settings.worker_id,
                claim_idle_ms=settings.claim_idle_ms,
                max_deliveries=settings.max_deliveries,
            )
            if redis is not None
            else None
        )
        worker = RolloutWorker(settings, clients, queue, metrics, tokenizer)
        app.state.worker = worker
        worker.start()
        try:
            yield
        finally:
            await worker.stop()
            await clients.aclose()
            if redis is not None:
                await redis.aclose()

    app = FastAPI(title="MemPO rollout worker", version="1", lifespan=lifespan)

    async def ready() -> tuple[bool, str | None]:
        worker: RolloutWorker | None = getattr(app.state, "worker", None)
        if worker is None:
            return False, "starting"
        await worker.check_redis()
        return worker.readiness()

    install_common(app, "rollout", metrics.metrics, ready, settings)

    app.include_router(router)
    return app
