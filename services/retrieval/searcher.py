"""The service's search: request limits, the index (loaded in the background), batching."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from mempo.api.retrieval import (
    Document,
    RetrievalInfo,
    RetrieveRequest,
    RetrieveResponse,
    ScoredDocument,
)
from mempo.batching import Batcher
from mempo.metrics import Metrics
from mempo.service import BadInput, NotReady, TooLarge
from services.retrieval.index import LoadedIndex, open_index
from services.retrieval.settings import RetrievalSettings

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


def check_limits(request: RetrieveRequest, settings: RetrievalSettings) -> None:
    """413 for too many queries or results (queries x topk), 422 for a query too long or a
    topk too large."""
    count = len(request.queries)
    if count > settings.max_queries:
        raise TooLarge(f"queries: {count} queries exceed max_queries={settings.max_queries}")
    for i, query in enumerate(request.queries):
        if len(query) > settings.max_query_chars:
            raise BadInput(
                f"queries.{i}: {len(query)} characters exceed "
                f"max_query_chars={settings.max_query_chars}"
            )
    if request.topk is not None and request.topk > settings.max_topk:
        raise BadInput(f"topk: {request.topk} exceeds max_topk={settings.max_topk}")
    results = count * (request.topk or settings.default_topk)
    if results > settings.max_results:
        raise TooLarge(
            f"queries x topk: {count} x {request.topk or settings.default_topk} = {results} results "
            f"exceed max_results={settings.max_results}"
        )


class RetrievalService:
    """Owns the index and the batcher; the routes call ``retrieve`` and ``info``."""

    def __init__(self, settings: RetrievalSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.index: LoadedIndex | None = None
        self.batcher: Batcher[tuple[str, int], list[ScoredDocument]] | None = None
        self.failure: str | None = None
        self.loader: asyncio.Task[None] | None = None
        self.queries = metrics.counter("queries_total", "Queries searched")
        self.search_latency = metrics.histogram(
            "search_latency_seconds", "Time to search one batch of queries"
        )
        self.batch_size = metrics.histogram(
            "batch_size_queries", "Queries per search batch", BATCH_BUCKETS
        )

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Load (or build) the index in a thread; /ready says when it is done."""
        self.loader = asyncio.get_running_loop().create_task(self._load())

    async def _load(self) -> None:
        try:
            index = await asyncio.to_thread(open_index, self.settings)
        except Exception as exc:  # reported by /ready and the log; the process stays up
            self.failure = f"the index failed to load: {type(exc).__name__}: {exc}"
            log.error("%s", self.failure)
            return
        batcher: Batcher[tuple[str, int], list[ScoredDocument]] = Batcher(
            self._search_rows,
            cost=lambda _row: 1,  # a query
            max_batch_cost=self.settings.batch_max_queries,
            max_wait_s=self.settings.batch_wait_ms / 1000,
            max_share=1.0,  # a request's queries in one search when they fit
            threads=self.settings.search_threads,
            on_batch=self._observe_batch,
            name="the retrieval service",
        )
        batcher.start()
        self.batcher = batcher
        self.index = index
        log.info(
            "serving %s over %d passages (%s)",
            index.backend.name,
            len(index.store),
            index.path or index.manifest.corpus,
        )

    async def close(self) -> None:
        if self.loader is not None and not self.loader.done():
            self.loader.cancel()
        if self.batcher is not None:
            await asyncio.to_thread(self.batcher.stop)

    def readiness(self) -> tuple[bool, str | None]:
        if self.index is not None:
            return True, None
        return False, self.failure or "the index is loading"

    # ----------------------------------------------------------------- search

    def _search_rows(
        self, rows: Sequence[tuple[str, int]]
    ) -> tuple[list[list[ScoredDocument]], str]:
        """Runs in a batcher thread: one search of the batch's queries at the largest k any
        of them asked for (top-k lists are prefixes of each other), each cut to its own k,
        then the documents looked up."""
        assert self.index is not None
        store = self.index.store
        hits = self.index.backend.search([q for q, _ in rows], max(k for _, k in rows))
        return [
            [ScoredDocument(document=store.document(r), score=score) for r, score in found[:k]]
            for found, (_, k) in zip(hits, rows, strict=True)
        ], ""

    def _observe_batch(self, _requests: int, size: int, seconds: float) -> None:
        self.queries.inc(size)
        self.batch_size.observe(size)
        self.search_latency.observe(seconds)

    async def retrieve(self, request: RetrieveRequest) -> RetrieveResponse:
        check_limits(request, self.settings)
        if self.batcher is None:
            raise NotReady(self.readiness()[1] or "not ready")
        k = request.topk or self.settings.default_topk
        results = (await self.batcher.submit([(q, k) for q in request.queries])).outputs
        if request.return_scores:
            return RetrieveResponse(result=results)
        return RetrieveResponse(result=_bare(results))

    def info(self) -> RetrievalInfo:
        if self.index is None:
            raise NotReady(self.readiness()[1] or "not ready")
        manifest = self.index.manifest
        return RetrievalInfo(
            backend=self.index.backend.name,
            corpus_size=len(self.index.store),
            index_build_s=manifest.build_s,
            index_path=str(self.index.path) if self.index.path else None,
            model=self.index.model,
            default_topk=self.settings.default_topk,
            corpus=manifest.corpus,
            corpus_sha256=manifest.corpus_sha256,
            max_queries=self.settings.max_queries,
            max_topk=self.settings.max_topk,
            max_query_chars=self.settings.max_query_chars,
        )


def _bare(results: Sequence[Sequence[ScoredDocument]]) -> list[list[Document]]:
    return [[item.document for item in hits] for hits in results]
