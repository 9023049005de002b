"""The agent loop against a scripted engine (the world's oracle) and real BM25 search."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from mempo.api.scorer import TrajectoryScores
from mempo.bm25 import LocalSearch
from mempo.clients.engine import Generation
from mempo.schemas import Group, Round, Task
from mempo_sim.world import World
from services.rollout.episode import CONTEXT, EpisodeConfig, EpisodeResult, EpisodeRunner
from services.rollout.group import GroupRunner, ScoringFailed, task_probability
from services.rollout.scripted import fake_logprob
from tests.services.rollout.scripted import (
    ScriptedEngine,
    ScriptedScorer,
    booted_worker,
    question_tail,
    tag_count,
)


def oracle_tasks(world: World, mode: str, n: int = 2) -> list[Task]:
    return [
        Task(questions=qs, answers=ans, n=n, mode=mode, max_rounds=24)
        for k in (1, 2, 3, 4)
        for qs, ans in world.tasks("test", k, 2, seed=k)
    ]


def engine_saw_exactly_the_rounds(engine: ScriptedEngine, groups: list[Group]) -> None:
    """Every round's prompt_ids / response_ids are one (input_ids, output_ids) pair of the engine."""
    recorded = Counter((tuple(p), tuple(r)) for p, r in engine.calls)
    rounds = Counter(
        (tuple(r.prompt_ids), tuple(r.response_ids))
        for g in groups
        for t in g.trajectories
        for r in t.rounds
    )
    assert rounds == recorded


@pytest.mark.parametrize("mode", ["memory", "full"])
async def test_the_oracle_gets_exact_match_on_1_to_4_questions(
    mode: str, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, mode)
    scorer = ScriptedScorer() if mode == "memory" else None
    async with booted_worker(engine, local_search, tokenizer, scorer) as worker:
        groups = [await worker.run_task(task) for task in oracle_tasks(world, mode)]
    for group in groups:
        k = len(group.task.questions)
        for traj in group.trajectories:
            assert traj.correct and traj.format_ok and traj.reward == 1.0, traj.answer_text
            assert traj.rounds[-1].action == "answer"
            assert len(traj.rounds) >= k + 1  # at least one search per question
            assert traj.num_tokens == sum(
                len(r.prompt_ids) + len(r.response_ids) for r in traj.rounds
            )
            for r in traj.rounds:
                assert r.response_logprobs == [fake_logprob(t) for t in r.response_ids]
                assert r.weight_version == "0"
        assert group.policy_version == 0 and group.worker_id == worker.settings.worker_id
        assert Group.model_validate_json(group.model_dump_json(context={"pack": True})) == group
    engine_saw_exactly_the_rounds(engine, groups)


async def test_memory_mode_prompts_hold_nothing_older_than_the_previous_round(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    async with booted_worker(engine, local_search, tokenizer, ScriptedScorer()) as worker:
        groups = [await worker.run_task(task) for task in oracle_tasks(world, "memory", n=1)]
    checked = 0
    for traj in (t for g in groups for t in g.trajectories):
        assert tag_count(question_tail(tokenizer.decode(traj.rounds[0].prompt_ids)), "mem") == 0
        for prev, cur in zip(traj.rounds, traj.rounds[1:], strict=False):
            tail = question_tail(tokenizer.decode(cur.prompt_ids))
            assert tag_count(tail, "mem") == 1 and tag_count(tail, "information") == 1
            assert tag_count(tail, "search") == 1 and f"<search> {prev.query}</search>" in tail
            assert prev.information is not None and prev.information.strip() in tail
            prev_memory = tokenizer.decode(prev.response_ids[slice(*prev.mem_span)])
            assert prev_memory.strip() in tail
            older = {r.query for r in traj.rounds[: prev.index]} - {prev.query}
            assert not any(f"<search>{q}</search>" in tail for q in older)
            checked += 1
    assert checked > 10


async def test_memory_mode_attaches_the_scorers_p_mem_and_p_full(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    scorer = ScriptedScorer()
    ((questions, answers),) = world.tasks("test", 2, 1, seed=5)
    task = Task(questions=questions, answers=answers, n=3, mode="memory", max_rounds=16)
    async with booted_worker(engine, local_search, tokenizer, scorer) as worker:
        group = await worker.run_task(task)
    assert group.scorer_version == "7"
    (request,) = scorer.requests  # one call for the whole task
    assert len(request.trajectories) == 3 and request.trajectories[0].answers == answers
    for traj, sent in zip(group.trajectories, request.trajectories, strict=True):
        assert len(sent.rounds) == len(traj.rounds)
        assert (
            len(traj.p_mem) == sum(r.mem_span is not None for r in traj.rounds) == len(traj.rounds)
        )
        memories = [tokenizer.decode(r.response_ids[slice(*r.mem_span)]) for r in traj.rounds]
        assert [s.memory for s in sent.rounds] == memories
        assert traj.p_mem == [
            0.9 if (">" in m or any(c.isdigit() for c in m)) else 0.2 for m in memories
        ]
        assert traj.p_full == [0.5] * len(traj.rounds)
        assert sent.rounds[0].transcript.endswith("</information>\n\n")


async def test_full_mode_appends_ids_and_skips_the_scorer(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "full")
    scorer = ScriptedScorer()
    ((questions, answers),) = world.tasks("test", 3, 1, seed=3)
    task = Task(questions=questions, answers=answers, n=1, mode="full", max_rounds=16)
    async with booted_worker(engine, local_search, tokenizer, scorer) as worker:
        group = await worker.run_task(task)
    assert scorer.requests == [] and group.scorer_version is None
    (traj,) = group.trajectories
    # The format writes <mem> in full mode too (its span is recorded); nothing scores it.
    assert traj.correct and traj.p_mem == [] and all(r.mem_span for r in traj.rounds)
    for prev, cur in zip(traj.rounds, traj.rounds[1:], strict=False):
        head = [*prev.prompt_ids, *prev.response_ids]
        assert cur.prompt_ids[: len(head)] == head  # appended, never re-tokenised
        info = tokenizer.decode(cur.prompt_ids[len(head) :])
        assert info == f"\n\n<information>{prev.information}</information>\n\n"


BROKEN = {
    "no tags": "I think the answer is Paris.",
    "unclosed": "<mem>Q1: ?</mem>\n<think>search it\n<search>Paris",
    "no action": "<mem>Q1: ?</mem>\n<think>hmm</think>",
    "nested": "<mem>Q1: <think>x</think></mem><answer>a</answer>",
    "huge": "<mem>" + "words and more words " * 3000,
}


@pytest.mark.parametrize("mode", ["memory", "full"])
@pytest.mark.parametrize("case", sorted(BROKEN))
async def test_broken_model_output_is_format_failure_not_a_crash(
    case: str, mode: str, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine(tokenizer, lambda prompt: BROKEN[case])
    ((questions, answers),) = world.tasks("test", 1, 1, seed=1)
    task = Task(questions=questions, answers=answers, n=2, mode=mode, max_rounds=4)
    async with booted_worker(engine, local_search, tokenizer, ScriptedScorer()) as worker:
        group = await worker.run_task(task)
    for traj in group.trajectories:
        assert not traj.format_ok and traj.reward == 0.0 and not traj.correct
        (only,) = traj.rounds
        assert only.action == "invalid" and only.response_ids == engine.calls[0][1]
    if case == "huge":
        assert group.trajectories[0].rounds[0].finish_reason == "length"
        assert len(group.trajectories[0].rounds[0].response_ids) == 256


async def test_max_rounds_without_an_answer_is_a_format_failure(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine(tokenizer, lambda p: "<mem>Q1: ?</mem><search>the same thing</search>")
    ((questions, answers),) = world.tasks("test", 1, 1, seed=2)
    task = Task(questions=questions, answers=answers, n=1, mode="memory", max_rounds=3)
    async with booted_worker(engine, local_search, tokenizer) as worker:
        (traj,) = (await worker.run_task(task)).trajectories
    assert [r.action for r in traj.rounds] == ["search"] * 3
    assert not traj.format_ok and traj.reward == 0.0


@pytest.mark.parametrize("where", ["worker", "engine"])
async def test_a_prompt_past_the_context_ends_the_episode_cleanly(
    where: str, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    """The worker's own check, or the engine's 400 when the worker's limit is too generous."""
    ((questions, answers),) = world.tasks("test", 3, 1, seed=4)
    task = Task(questions=questions, answers=answers, n=2, mode="full", max_rounds=24)
    engine = ScriptedEngine.oracle(tokenizer, world, "full", context_length=600)
    limit = {"max_context_tokens": 100_000} if where == "engine" else {}
    async with booted_worker(engine, local_search, tokenizer, max_new_tokens=64, **limit) as worker:
        assert worker.max_context_tokens == (100_000 if where == "engine" else 600)
        group = await worker.run_task(task)
    for traj in group.trajectories:
        last = traj.rounds[-1]
        assert last.finish_reason == "context" and len(last.response_ids) == 0
        assert len(last.prompt_ids) + 64 > 600
        assert traj.format_ok and traj.reward == 0.0 and traj.answer_text is None
        assert all(r.action == "search" for r in traj.rounds[:-1]) and len(traj.rounds) >= 2
        assert traj.num_tokens == sum(
            len(r.prompt_ids) + len(r.response_ids) for r in traj.rounds[:-1]
        )


async def test_an_engine_abort_is_regenerated(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    engine.aborts_left = 2
    ((questions, answers),) = world.tasks("test", 1, 1, seed=6)
    task = Task(questions=questions, answers=answers, n=1, mode="memory", max_rounds=8)
    async with booted_worker(engine, local_search, tokenizer) as worker:
        (traj,) = (await worker.run_task(task)).trajectories
    assert traj.correct and len(engine.calls) == len(traj.rounds) + 2
    assert all(r.finish_reason == "stop" for r in traj.rounds)


class OneShot:
    """A generator whose last token runs past the stop string, as real BPE tokens can."""

    def __init__(self, tokenizer: Any, text: str, matched: str) -> None:
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.matched = matched

    async def generate(self, input_ids: Any, sampling_params: Any, return_logprob: bool = True, rid: Any = None) -> list[Generation]:
        return [Generation(self.ids, [-0.5] * len(self.ids), "", "stop", self.matched, "0", len(input_ids))]


class NoSearch:
    async def search(self, query: str, topk: int | None = None) -> str:
        return f"Doc 1(Title: {query}) nothing"


async def test_text_past_the_matched_stop_string_is_not_a_format_error(tokenizer: Any) -> None:
    text = "<mem>Q1: ?</mem>\n<think>look</think>\n<search>Mirath</search>. And more"
    runner = EpisodeRunner(OneShot(tokenizer, text, "</search>"), NoSearch(), tokenizer, EpisodeConfig())
    result = await runner.run(Task(questions=["Who?"], answers=[["x"]], n=1, max_rounds=1))
    (round_,) = result.rounds
    assert round_.action == "search" and round_.query == "Mirath"
    assert round_.response_ids == tokenizer.encode(text, add_special_tokens=False)  # ids untouched
    assert result.texts == [tokenizer.decode(round_.response_ids, skip_special_tokens=True)]


@pytest.mark.parametrize("asked", [False, True])
async def test_p_task_reaches_every_trajectory_when_the_task_asks(
    asked: bool, tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    scorer = ScriptedScorer(p_task=0.125)
    ((questions, answers),) = world.tasks("test", 1, 1, seed=8)
    task = Task(questions=questions, answers=answers, n=2, max_rounds=8, score_task=asked)
    async with booted_worker(engine, local_search, tokenizer, scorer) as worker:
        group = await worker.run_task(task)
    (request,) = scorer.requests
    assert request.task_score is asked
    assert [t.p_task for t in group.trajectories] == [0.125 if asked else None] * 2
    assert Group.model_validate_json(group.model_dump_json(context={"pack": True})) == group


async def test_a_task_that_asks_fails_without_the_scorers_p_task(
    tokenizer: Any, world: World, local_search: LocalSearch
) -> None:
    engine = ScriptedEngine.oracle(tokenizer, world, "memory")
    ((questions, answers),) = world.tasks("test", 1, 1, seed=8)
    task = Task(questions=questions, answers=answers, n=1, max_rounds=8, score_task=True)
    async with booted_worker(engine, local_search, tokenizer, ScriptedScorer(p_task=None)) as worker:
        with pytest.raises(ScoringFailed, match="no p_task"):
            await worker.run_task(task)


def test_p_task_is_read_like_p_mem() -> None:
    asked = Task(questions=["q"], answers=[["a"]], score_task=True)
    scores = [TrajectoryScores(rounds=[], candidates=["a"], p_task=p) for p in (None, 1.0 + 1e-9)]
    assert task_probability(asked, scores) == 1.0  # the first given, clamped into [0, 1]
    assert task_probability(asked.model_copy(update={"score_task": False}), scores) is None
    with pytest.raises(ScoringFailed, match="p_task is nan"):
        task_probability(asked, [TrajectoryScores(rounds=[], candidates=["a"], p_task=float("nan"))])


async def test_a_trajectory_with_nothing_to_score_gets_the_tasks_p_task() -> None:
    """One episode ended on its context before generating: it is not sent, yet takes P_task."""
    scored = EpisodeResult(
        rounds=[Round(index=0, prompt_ids=[1, 2], response_ids=[5, 6], response_logprobs=[-1.0, -1.0],
                      mem_span=(0, 1), action="answer")],
        texts=["<mem>x</mem><answer>a</answer>"], memories=["x"],
    )  # fmt: skip
    context_only = EpisodeResult(
        rounds=[Round(index=0, prompt_ids=[1], response_ids=[], response_logprobs=[], action="invalid",
                      finish_reason=CONTEXT)],
        texts=[""], memories=[None],
    )  # fmt: skip
    scorer = ScriptedScorer(p_task=0.25)
    runner = GroupRunner(None, scorer.client(), asyncio.Semaphore(1), "w")  # type: ignore[arg-type]
    task = Task(questions=["q"], answers=[["a"]], n=2, score_task=True)
    try:
        trajectories, _ = await runner._score(task, [scored, context_only])
    finally:
        await runner.scorer.http.aclose()  # type: ignore[union-attr]
    (request,) = scorer.requests
    assert len(request.trajectories) == 1 and request.task_score
    assert [t.p_task for t in trajectories] == [0.25, 0.25]
    assert [len(t.p_mem) for t in trajectories] == [1, 0]
