"""The CPU engine's HTTP app: SGLang's native routes and JSON shapes.

Public: /generate, /model_info (+ /get_model_info), /server_info (+ /get_server_info),
/health (the scheduler thread is alive), /health_generate, /ready (503 while paused),
/metrics. Admin (bearer token): /update_weights_from_disk, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group (weights broadcast over
gloo), /flush_cache, /pause_generation, /continue_generation, /abort_request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from mempo.api.engine import (
    AbortRequest,
    ContinueRequest,
    ControlResponse,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    ModelInfo,
    PauseRequest,
    ServerInfo,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsResponse,
)
from mempo.disconnects import client_gone
from mempo.metrics import Metrics
from mempo.service import AdminDep, Health, install_common
from services.rollout.engine.contract import check_sampling_keys
from services.rollout.engine.engine import Engine
from services.rollout.engine.errors import install_sglang_errors
from services.rollout.engine.settings import EngineSettings

FLUSHED = "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"


def get_engine(request: Request) -> Engine:
    return request.app.state.engine  # type: ignore[no-any-return]


EngineDep = Annotated[Engine, Depends(get_engine)]


def _answer(result: UpdateWeightsResponse) -> Response:
    """SGLang's weight routes: 200 on success, 400 with the message otherwise."""
    return JSONResponse(result.model_dump(), 200 if result.success else 400)


router = APIRouter()  # declarative routes; the engine comes from app.state


@router.post(
    "/generate",
    response_model=GenerateResponse | list[GenerateResponse],
    response_model_exclude_none=True,
    tags=["generate"],
)
@router.put(
    "/generate",
    response_model=GenerateResponse | list[GenerateResponse],
    response_model_exclude_none=True,
    include_in_schema=False,
)
async def generate(
    req: GenerateRequest, engine: EngineDep, request: Request
) -> GenerateResponse | list[GenerateResponse]:
    """Generate from token ids or text; a batch or n > 1 answers a list. A client that
    disconnects aborts its samples. Unknown sampling_params keys are 400, as SGLang."""
    check_sampling_keys(await request.json())  # the body FastAPI read, cached
    return await engine.generate(req, lambda: client_gone(request))


@router.get("/health", response_model=Health, tags=["ops"], responses={503: {}})
async def scheduler_health(engine: EngineDep) -> Response:
    """200 while the scheduler thread is alive."""
    ok = engine.runtime.alive
    return JSONResponse(
        Health(status="ok" if ok else "dead", service="engine").model_dump(), 200 if ok else 503
    )


@router.get("/health_generate", response_model=Health, tags=["ops"], responses={503: {}})
async def health_generate(engine: EngineDep) -> Response:
    """200 when a 1-token generation completes within the health timeout."""
    ok = await engine.health_generate()
    return JSONResponse(
        Health(status="ok" if ok else "stuck", service="engine").model_dump(),
        200 if ok else 503,
    )


@router.get("/model_info", response_model=ModelInfo, tags=["info"])
@router.get("/get_model_info", response_model=ModelInfo, tags=["info"], include_in_schema=False)
async def model_info(engine: EngineDep) -> ModelInfo:
    return engine.model_info()


@router.get("/server_info", response_model=ServerInfo, tags=["info"])
@router.get("/get_server_info", response_model=ServerInfo, tags=["info"], include_in_schema=False)
async def server_info(engine: EngineDep) -> ServerInfo:
    return engine.server_info()


@router.post("/update_weights_from_disk", response_model=UpdateWeightsResponse, tags=["admin"])
async def update_weights_from_disk(
    req: UpdateWeightsFromDiskRequest, engine: EngineDep, _: AdminDep
) -> Response:
    """Load HF safetensors from model_path (inside the weights root) between batches."""
    return _answer(await engine.update_weights_from_disk(req))


@router.post("/init_weights_update_group", response_model=UpdateWeightsResponse, tags=["admin"])
async def init_weights_update_group(
    req: InitWeightsUpdateGroupRequest, engine: EngineDep, _: AdminDep
) -> Response:
    """Join the learner's weight-update group (gloo here); answers once all have joined."""
    return _answer(await engine.init_weights_update_group(req))


@router.post(
    "/update_weights_from_distributed", response_model=UpdateWeightsResponse, tags=["admin"]
)
async def update_weights_from_distributed(
    req: UpdateWeightsFromDistributedRequest, engine: EngineDep, _: AdminDep
) -> Response:
    """Receive the bucket the learner broadcasts now (``load_format: flattened_bucket``:
    one tensor of bytes) and load it between batches."""
    return _answer(await engine.update_weights_from_distributed(req))


@router.post("/destroy_weights_update_group", response_model=UpdateWeightsResponse, tags=["admin"])
async def destroy_weights_update_group(
    engine: EngineDep, _: AdminDep, req: DestroyWeightsUpdateGroupRequest | None = None
) -> Response:
    return _answer(
        await engine.destroy_weights_update_group(req or DestroyWeightsUpdateGroupRequest())
    )


@router.post("/flush_cache", response_class=PlainTextResponse, tags=["admin"])
@router.get("/flush_cache", response_class=PlainTextResponse, include_in_schema=False)
async def flush_cache(engine: EngineDep, _: AdminDep) -> Response:
    """No prefix cache to flush; 400 while requests run or wait, as SGLang."""
    return PlainTextResponse(FLUSHED, 200 if engine.idle() else 400)


@router.post("/pause_generation", response_model=ControlResponse, tags=["admin"])
async def pause_generation(
    engine: EngineDep, _: AdminDep, req: PauseRequest | None = None
) -> ControlResponse:
    """abort: abort in-flight requests; in_place/retract: keep them. New ones wait."""
    await engine.pause((req or PauseRequest()).mode)
    return ControlResponse(message="Generation paused successfully.")


@router.post("/continue_generation", response_model=ControlResponse, tags=["admin"])
async def continue_generation(
    engine: EngineDep, _: AdminDep, req: ContinueRequest | None = None
) -> ControlResponse:
    engine.runtime.resume()
    return ControlResponse(message="Generation continued successfully.")


@router.post("/abort_request", response_class=Response, tags=["admin"])
async def abort_request(req: AbortRequest, engine: EngineDep, _: AdminDep) -> Response:
    """Abort every request whose rid starts with ``rid`` (or all); they finish with abort."""
    rid = req.rid
    engine.runtime.abort(lambda r: req.abort_all or (bool(rid) and r.startswith(rid)))
    return Response(status_code=200)


def create_app(settings: EngineSettings | None = None) -> FastAPI:
    settings = settings or EngineSettings()
    metrics = Metrics("engine")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = await asyncio.to_thread(Engine.load, settings, metrics)
        yield
        await asyncio.to_thread(app.state.engine.close)

    app = FastAPI(title="mempo CPU engine (SGLang API)", version="0.1.0", lifespan=lifespan)
    app.include_router(router)

    async def ready() -> tuple[bool, str | None]:
        engine: Engine | None = getattr(app.state, "engine", None)
        if engine is None or not engine.runtime.alive:
            return False, "the engine is not running"
        if engine.runtime.paused:
            return False, "generation is paused"
        return True, None

    install_common(app, "engine", metrics, ready, settings)
    install_sglang_errors(app)  # SGLang's 400 / 401 answers instead of 422 / 403
    return app
