"""The scorer's HTTP app: P_mem / P_full memory scores, generic answer scores, weights."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from mempo.api.engine import ModelInfo, UpdateWeightsFromDiskRequest, UpdateWeightsResponse
from mempo.api.scorer import MemoryScoresRequest, MemoryScoresResponse, ScoreRequest, ScoreResponse
from mempo.disconnects import cancel_on_disconnect
from mempo.metrics import Metrics
from mempo.service import AdminDep, ErrorBody, Forbidden, inside_root, install_common, without_root
from mempo.settings import quiet_hub
from mempo.weights import WeightsOutsideRoot
from services.scorer.model import LoadedModel, load_initial
from services.scorer.registry import Registration
from services.scorer.scorer import ScorerService
from services.scorer.settings import ScorerSettings

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (401, 403, 413, 422, 503)
}


def get_scorer(request: Request) -> ScorerService:
    return request.app.state.scorer  # type: ignore[no-any-return]


ScorerDep = Annotated[ScorerService, Depends(get_scorer)]


router = APIRouter()  # declarative routes; every resource comes from app.state


@router.post(
    "/v1/memory-scores", response_model=MemoryScoresResponse, responses=ERRORS, tags=["scoring"]
)
async def memory_scores(
    body: MemoryScoresRequest, scorer: ScorerDep, request: Request
) -> MemoryScoresResponse:
    """P_mem, P_full and R_M = P_mem - P_full for every round of one or many trajectories.
    A client that disconnects has the rest of its rows dropped from the batches."""
    return await cancel_on_disconnect(request, scorer.memory_scores(body))


@router.post("/v1/score", response_model=ScoreResponse, responses=ERRORS, tags=["scoring"])
async def score(body: ScoreRequest, scorer: ScorerDep, request: Request) -> ScoreResponse:
    """Log-prob sum, mean, token count and P of the best (or first) answer alias per item."""
    return await cancel_on_disconnect(request, scorer.score(body))


@router.post(
    "/update_weights_from_disk",
    response_model=UpdateWeightsResponse,
    responses={400: {"model": UpdateWeightsResponse}, **ERRORS},
    tags=["weights"],
)
async def update_weights(
    body: UpdateWeightsFromDiskRequest, scorer: ScorerDep, _: AdminDep
) -> Response:
    """Load HF weights from a folder inside the weights root (SGLang's route and shapes)."""
    path = inside_root(body.model_path, scorer.settings.weights_root)
    try:
        is_folder = path.is_dir()
    except OSError:  # a name longer than the file system allows
        is_folder = False
    if not is_folder:
        shown = without_root(str(path), scorer.settings.weights_root)
        failed = UpdateWeightsResponse(success=False, message=f"model_path: {shown} is not a folder")
        return JSONResponse(failed.model_dump(), 400)
    try:
        new = await scorer.update_weights(path, body.weight_version)
    except WeightsOutsideRoot as exc:  # a file of the folder links out of the root
        raise Forbidden(str(exc)) from exc
    except Exception as exc:  # a checkpoint that does not load: SGLang answers 400
        failed = UpdateWeightsResponse(
            success=False, message=without_root(f"model_path: cannot load: {exc}", scorer.settings.weights_root)[:500]
        )
        return JSONResponse(failed.model_dump(), 400)
    ok = UpdateWeightsResponse(success=True, message=f"loaded weight version {new.version}")
    return JSONResponse(ok.model_dump())


@router.get("/model_info", response_model=ModelInfo, tags=["weights"])
async def model_info(scorer: ScorerDep) -> ModelInfo:
    """The model path and the weight version new requests are scored with."""
    return scorer.model_info()


def _lifespan(
    settings: ScorerSettings, loaded: LoadedModel | None, metrics: Metrics
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Load the model, start the batcher and the registry heartbeat; drain on the way out."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        quiet_hub()
        if loaded is None:
            model = await asyncio.to_thread(
                load_initial, settings.model_path, settings.weight_version, settings.device
            )
        else:
            model = loaded
        scorer = ScorerService(settings, model, metrics)
        scorer.start()
        app.state.scorer = scorer
        stop = asyncio.Event()
        registration = Registration(scorer, settings) if settings.redis_url else None
        app.state.registration = registration
        task = asyncio.create_task(registration.run(stop)) if registration else None
        try:
            yield
        finally:
            stop.set()
            if task is not None and registration is not None:
                await task
                await registration.close()
            await asyncio.to_thread(scorer.stop)

    return lifespan


def create_app(
    settings: ScorerSettings | None = None, loaded: LoadedModel | None = None
) -> FastAPI:
    """The scorer app; ``loaded`` skips loading the configured model (tests share one)."""
    settings = settings or ScorerSettings()
    metrics = Metrics("scorer")
    app = FastAPI(
        title="MemPO scorer", version="0.1.0", lifespan=_lifespan(settings, loaded, metrics)
    )

    async def ready() -> tuple[bool, str | None]:
        scorer = getattr(app.state, "scorer", None)
        if scorer is None or not scorer.batcher.running:
            return False, "the model is not loaded"
        registration = getattr(app.state, "registration", None)
        if registration is not None and registration.problem:
            return False, registration.problem  # it would never receive weight updates
        return True, None

    install_common(app, "scorer", metrics, ready, settings)
    app.include_router(router)
    return app
