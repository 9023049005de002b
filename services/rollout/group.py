"""One task -> one Group: n episodes concurrently, outcome rewards, memory scores.

The n episodes run under a semaphore shared by every task of the worker. In memory
mode one scorer call carries all n trajectories (the task's gold answers and, per
round, the memory and the transcript); each trajectory keeps P_mem / P_full for its
rounds with a memory. A failure anywhere (engine, retrieval, scorer) fails the whole
task: a partial group is never built.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from mempo.agent_format import round_transcript
from mempo.api.scorer import MemoryRound, MemoryTrajectory, TrajectoryScores
from mempo.clients.scorer import ScorerClient
from mempo.schemas import Group, Task, Trajectory, parse_weight_version
from services.rollout.episode import CONTEXT, EpisodeResult, EpisodeRunner

T = TypeVar("T")


class ScoringFailed(Exception):
    """The scorer failed, or its answer does not fit the trajectories that were sent."""


class GroupRunner:
    def __init__(
        self,
        episodes: EpisodeRunner,
        scorer: ScorerClient | None,
        semaphore: asyncio.Semaphore,
        worker_id: str,
    ) -> None:
        self.episodes = episodes
        self.scorer = scorer
        self.semaphore = semaphore
        self.worker_id = worker_id

    async def run(self, task: Task, score: bool = True) -> Group:
        results = await gather_or_cancel([self._episode(task) for _ in range(task.n)])
        scorer_version = None
        if task.mode == "memory" and score and self.scorer is not None:
            trajectories, scorer_version = await self._score(task, results)
        else:
            trajectories = [r.trajectory() for r in results]
        return Group(
            group_id=task.group_id,
            task=task,
            trajectories=trajectories,
            policy_version=min(  # weights that are no policy version count as 0 (the oldest)
                parse_weight_version(r.weight_version) or 0 for t in trajectories for r in t.rounds
            ),
            scorer_version=scorer_version,
            worker_id=self.worker_id,
            temperature=self.episodes.config.temperature,
        )

    async def _episode(self, task: Task) -> EpisodeResult:
        async with self.semaphore:
            return await self.episodes.run(task)

    async def _score(
        self, task: Task, results: list[EpisodeResult]
    ) -> tuple[list[Trajectory], str | None]:
        """P_mem / P_full per round with a memory, from one scorer call for the whole task;
        P_task too when the task asks (every trajectory gets it, also one with nothing to
        score; when no trajectory has anything to score nothing is sent and it stays None)."""
        assert self.scorer is not None
        payload = [(i, scoring_rounds(r)) for i, r in enumerate(results)]
        payload = [(i, rounds) for i, rounds in payload if rounds]  # context-only: nothing to score
        if not payload:
            return [r.trajectory() for r in results], None
        try:
            scores = await self.scorer.memory_scores(
                [
                    MemoryTrajectory(questions=task.questions, answers=task.answers, rounds=rounds)
                    for _, rounds in payload
                ],
                task_score=task.score_task,
            )
        except Exception as exc:  # ScorerError, 5xx after the retries, transport errors
            raise ScoringFailed(f"the scorer failed: {type(exc).__name__}: {exc}") from exc
        if len(scores.results) != len(payload):
            raise ScoringFailed(
                f"the scorer answered {len(scores.results)} trajectories for {len(payload)}"
            )
        probabilities = {
            i: memory_probabilities(results[i], scores.results[j], len(rounds))
            for j, (i, rounds) in enumerate(payload)
        }
        p_task = task_probability(task, scores.results)
        trajectories = [
            r.trajectory(*probabilities.get(i, ([], []))).model_copy(update={"p_task": p_task})
            for i, r in enumerate(results)
        ]
        return trajectories, scores.weight_version


def task_probability(task: Task, results: Sequence[TrajectoryScores]) -> float | None:
    """The task's P_task from the scorer's answer (one per task: the first); None unless asked."""
    if not task.score_task:
        return None
    p_task = next((s.p_task for s in results if s.p_task is not None), None)
    if p_task is None:
        raise ScoringFailed("no p_task in the scorer's answer, though the task asks for it")
    p_task = _probability(p_task)
    if not 0.0 <= p_task <= 1.0:  # NaN (the trajectories take it without validation)
        raise ScoringFailed(f"the scorer's p_task is {p_task}")
    return p_task


def scoring_rounds(result: EpisodeResult) -> list[MemoryRound]:
    """The rounds the scorer sees: every generated round (a context round generated nothing)."""
    return [
        MemoryRound(memory=memory, transcript=round_transcript(text, round_.information))
        for round_, text, memory in zip(result.rounds, result.texts, result.memories, strict=True)
        if round_.finish_reason != CONTEXT
    ]


def memory_probabilities(
    result: EpisodeResult, scores: TrajectoryScores, sent: int
) -> tuple[list[float], list[float]]:
    """(p_mem, p_full) of the rounds with a memory; the scored rounds are a prefix of the
    episode's (only its last round can be a context round, which is not sent)."""
    if len(scores.rounds) != sent:
        raise ScoringFailed(f"the scorer answered {len(scores.rounds)} rounds for {sent}")
    p_mem: list[float] = []
    p_full: list[float] = []
    for round_score, memory in zip(scores.rounds, result.memories, strict=False):
        if memory is None:
            continue
        if round_score.p_mem is None:
            raise ScoringFailed(f"no p_mem for round {round_score.index}, which has a memory")
        p_mem.append(_probability(round_score.p_mem))
        p_full.append(_probability(round_score.p_full))
    return p_mem, p_full


def _probability(p: float) -> float:
    return min(max(float(p), 0.0), 1.0)


async def gather_or_cancel(aws: Sequence[Awaitable[T]]) -> list[T]:
    """Like asyncio.gather, but the first failure cancels the others before it is raised."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if pending:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    errors = [e for e in (t.exception() for t in done) if e is not None]  # retrieve them all
    if errors:
        raise errors[0]
    return [t.result() for t in tasks]
