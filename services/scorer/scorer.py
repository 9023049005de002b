"""The scorer: requests -> scoring plans -> batched forwards -> P_mem, P_full, rewards.

Planning (tokenisation) runs in a thread per request, after the request's size (how
many trajectories or items, how many bytes of text) has been checked against the limits:
bytes bound the tokens, so an oversized request is refused before any work. Within the
byte limits, entries are tokenised one at a time, each checked as it is planned: the
first trajectory or item over max_sequence_tokens, or the one that takes the request
over max_request_tokens, is refused (413) and nothing after it is tokenised. Forwards run
on the batcher's worker thread, which reads the current model once per batch, so a
weight update never changes the weights under a batch that has started.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from mempo.api.engine import ModelInfo
from mempo.api.scorer import (
    AliasPolicy,
    MemoryScoresRequest,
    MemoryScoresResponse,
    MemoryTrajectory,
    ScoreItem,
    ScoreRequest,
    ScoreResponse,
)
from mempo.batching import Batcher
from mempo.metrics import Metrics
from mempo.service import BadInput, TooLarge, require_weights_root
from services.scorer.forward import score_rows
from services.scorer.model import LoadedModel, ModelHolder
from services.scorer.plan import (
    LogProbTable,
    Plan,
    Row,
    RowTooLong,
    item_results,
    memory_results,
    plan_item,
    plan_memory,
)
from services.scorer.settings import ScorerSettings

log = logging.getLogger(__name__)


class ScorerService:
    def __init__(self, settings: ScorerSettings, initial: LoadedModel, metrics: Metrics) -> None:
        self.settings = settings
        self.holder = ModelHolder(initial)
        self._contexts = metrics.counter("scored_contexts_total", "answer contexts scored")
        self._batch_seconds = metrics.histogram(
            "batch_latency_seconds", "time to run one batch of requests"
        )
        self._batch_tokens = metrics.histogram(
            "batch_size_tokens",
            "tokens per batch of requests",
            buckets=(256, 1024, 4096, 16384, 65536, 262144, 1048576),
        )
        self._updates = metrics.counter(
            "weight_updates_total", "weight updates by outcome", ("outcome",)
        )
        self.batcher: Batcher[Row, dict[int, list[float]]] = Batcher(
            self._run_rows,
            cost=lambda row: row.num_tokens,
            max_batch_cost=settings.max_batch_tokens,
            max_wait_s=settings.max_wait_ms / 1000,
            max_queue=settings.max_queue,
            on_batch=self._observe_batch,
            max_share=settings.max_batch_share,
            name="the scorer",
        )

    @property
    def current(self) -> LoadedModel:
        return self.holder.current

    def start(self) -> None:
        self.batcher.start()

    def stop(self) -> None:
        self.batcher.stop()

    def _observe_batch(self, jobs: int, tokens: int, seconds: float) -> None:
        self._batch_seconds.observe(seconds)
        self._batch_tokens.observe(tokens)

    # ----------------------------------------------------------------- forwards (worker thread)

    def _run_rows(self, rows: Sequence[Row]) -> tuple[list[dict[int, list[float]]], str]:
        """Each row's log-probs by scored segment, and the weight version of them all."""
        loaded = self.holder.current  # one snapshot for the whole batch
        table = score_rows(
            loaded.model, rows, self.settings.max_batch_tokens, self.settings.method, loaded.pad_id
        )
        self._contexts.inc(sum(len(r.scored_segments()) for r in rows))
        per_row: list[dict[int, list[float]]] = [{} for _ in rows]
        for (row, segment), values in table.items():
            per_row[row][segment] = values
        return per_row, loaded.version

    async def _score(self, rows: Sequence[Row]) -> tuple[LogProbTable, str]:
        """The request's rows through the batcher: its log-prob table and weight version."""
        result = await self.batcher.submit(rows)
        table = {
            (row, segment): values
            for row, segments in enumerate(result.outputs)
            for segment, values in segments.items()
        }
        return table, result.version

    # ----------------------------------------------------------------- planning (request threads)

    def _sequence_limit(self) -> int:
        """The tokens one trajectory or item may hold: max_sequence_tokens, or the model's
        positions where fewer (the limit really applied, which the byte caps derive from)."""
        limit = self.settings.max_sequence_tokens
        positions = self.holder.current.max_positions
        return min(limit, positions) if positions else limit

    @staticmethod
    def _too_long(field: str, i: int, error: RowTooLong) -> TooLarge:
        return TooLarge(
            f"{field}.{i}: {error.tokens} tokens or more with its scoring branches exceed the "
            f"limit of {error.limit} (max_sequence_tokens); nothing after that point was "
            "tokenised"
        )

    def _count(self, plan: Plan, total: int, field: str, i: int) -> int:
        """The request's tokens with entry ``i`` (the plan's last row) added; 413 over
        max_request_tokens, before the entries after it are tokenised."""
        total += plan.rows[-1].num_tokens
        limit = self.settings.max_request_tokens
        if total > limit:
            raise TooLarge(
                f"{field}: {total} tokens up to {field}.{i} exceed the request limit of "
                f"{limit} (max_request_tokens); the {field} after it were not tokenised"
            )
        return total

    def _check_size(
        self,
        entries: Sequence[MemoryTrajectory] | Sequence[ScoreItem],
        texts: Callable[[object], Iterator[str]],
        field: str,
        max_entries: int,
    ) -> None:
        """413 before tokenising: too many entries, or more text bytes than the token
        limits could hold at max_text_bytes_per_token."""
        settings = self.settings
        if len(entries) > max_entries:
            raise TooLarge(
                f"{field}: {len(entries)} exceed the limit of {max_entries} per request "
                f"(max_{field})"
            )
        per_entry = int(self._sequence_limit() * settings.max_text_bytes_per_token)
        total = 0
        for i, entry in enumerate(entries):
            size = text_bytes(texts(entry))
            if size > per_entry:
                raise TooLarge(
                    f"{field}.{i}: {size} bytes of text exceed the limit of {per_entry} "
                    "(the sequence limit x max_text_bytes_per_token); it was not tokenised"
                )
            total += size
        per_request = int(settings.max_request_tokens * settings.max_text_bytes_per_token)
        if total > per_request:
            raise TooLarge(
                f"{field}: {total} bytes of text exceed the request limit of {per_request} "
                "(max_request_tokens x max_text_bytes_per_token); it was not tokenised"
            )

    def _policy(self, requested: AliasPolicy | None) -> AliasPolicy:
        return requested or self.settings.alias_policy

    def plan_memory_request(self, request: MemoryScoresRequest) -> Plan:
        tok, policy = self.holder.current.tokenizer, self._policy(request.alias_policy)
        limit, plan, total = self._sequence_limit(), Plan(), 0
        tasks: dict[str, int] = {}  # a task's questions and answers -> the entry scoring its P_task
        for i, trajectory in enumerate(request.trajectories):
            key = json.dumps([trajectory.questions, trajectory.answers])
            first = request.task_score and key not in tasks
            try:
                plan_memory(plan, tok, trajectory, policy, limit, task=first)
            except RowTooLong as error:
                raise self._too_long("trajectories", i, error) from None
            if request.task_score:
                plan.memory[-1].task_of = tasks.setdefault(key, len(plan.memory) - 1)
            total = self._count(plan, total, "trajectories", i)
        return plan

    def plan_score_request(self, request: ScoreRequest) -> Plan:
        tok, policy = self.holder.current.tokenizer, self._policy(request.alias_policy)
        limit, plan, total = self._sequence_limit(), Plan(), 0
        for i, item in enumerate(request.items):
            try:
                planned = plan_item(plan, tok, item, policy, limit)
            except RowTooLong as error:
                raise self._too_long("items", i, error) from None
            if not planned:
                raise BadInput(f"items.{i}.context: renders to no tokens")
            total = self._count(plan, total, "items", i)
        return plan

    # ----------------------------------------------------------------- requests

    async def memory_scores(self, request: MemoryScoresRequest) -> MemoryScoresResponse:
        trajectories = request.trajectories
        limit = self.settings.max_trajectories
        self._check_size(trajectories, trajectory_texts, "trajectories", limit)
        plan = await asyncio.to_thread(self.plan_memory_request, request)
        table, version = await self._score(plan.rows)
        return MemoryScoresResponse(results=memory_results(plan, table), weight_version=version)

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        self._check_size(request.items, item_texts, "items", self.settings.max_items)
        plan = await asyncio.to_thread(self.plan_score_request, request)
        table, version = await self._score(plan.rows)
        return ScoreResponse(scores=item_results(plan, table), weight_version=version)

    # ----------------------------------------------------------------- weights

    async def update_weights(self, path: Path, version: str | None) -> LoadedModel:
        """Load ``path`` beside the current model and swap; raises when it cannot load
        (Forbidden with no weights root; mempo.weights.WeightsFormatError for a folder
        that does not fit the model)."""
        new_version = version if version is not None else self.current.version
        root = require_weights_root(self.settings.weights_root)
        try:
            loaded = await asyncio.to_thread(self.holder.update, path, new_version, root)
        except Exception:
            self._updates.labels("failed").inc()
            raise
        self._updates.labels("ok").inc()
        log.info("weights updated to version %s from %s", loaded.version, path)
        return loaded

    def model_info(self) -> ModelInfo:
        loaded = self.current
        return ModelInfo(
            model_path=loaded.path,
            tokenizer_path=loaded.tokenizer_path or loaded.path,
            weight_version=loaded.version,
        )


# --------------------------------------------------------------------------- request sizes


def text_bytes(texts: Iterator[str]) -> int:
    """UTF-8 bytes of the strings (ASCII without encoding)."""
    return sum(len(t) if t.isascii() else len(t.encode("utf-8")) for t in texts)


def trajectory_texts(trajectory: object) -> Iterator[str]:
    assert isinstance(trajectory, MemoryTrajectory)
    yield from trajectory.questions
    for aliases in trajectory.answers:
        yield from aliases
    for r in trajectory.rounds:
        yield r.transcript
        if r.memory is not None:
            yield r.memory


def item_texts(item: object) -> Iterator[str]:
    assert isinstance(item, ScoreItem)
    if isinstance(item.context, str):
        yield item.context
    else:
        for message in item.context:
            yield message.role
            yield message.content
    yield from item.answers
