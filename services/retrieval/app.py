"""The retrieval service's HTTP app: Search-R1's ``POST /retrieve`` plus ``/v1/info``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request

from mempo.api.retrieval import RetrievalInfo, RetrieveRequest, RetrieveResponse
from mempo.metrics import Metrics
from mempo.service import ErrorBody, install_common
from services.retrieval.searcher import RetrievalService
from services.retrieval.settings import RetrievalSettings

ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody} for code in (413, 422, 503)}


def get_service(request: Request) -> RetrievalService:
    return request.app.state.retrieval  # type: ignore[no-any-return]


ServiceDep = Annotated[RetrievalService, Depends(get_service)]
router = APIRouter()


@router.post("/retrieve", response_model=RetrieveResponse, responses=ERRORS, tags=["search"])
async def retrieve(body: RetrieveRequest, service: ServiceDep) -> RetrieveResponse:
    """Search-R1's retriever: top-k documents per query (``{document, score}`` items when
    ``return_scores`` is true, bare documents otherwise)."""
    return await service.retrieve(body)


@router.get("/v1/info", response_model=RetrievalInfo, responses=ERRORS, tags=["search"])
async def info(service: ServiceDep) -> RetrievalInfo:
    """The backend, corpus size and index provenance."""
    return service.info()


def create_app(settings: RetrievalSettings | None = None) -> FastAPI:
    settings = settings or RetrievalSettings()
    metrics = Metrics("retrieval")
    service = RetrievalService(settings, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        yield
        await service.close()

    app = FastAPI(title="MemPO retrieval", version="1", lifespan=lifespan)
    app.state.retrieval = service

    async def ready() -> tuple[bool, str | None]:
        return service.readiness()

    install_common(app, "retrieval", metrics, ready, settings)
    app.include_router(router)
    return app
