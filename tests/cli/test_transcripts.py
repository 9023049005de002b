"""Reading episodes (mempo_cli/launcher/transcripts.py): the failure kinds of docs/results.md
told apart on episodes written as the agent writes them, and the Markdown transcript."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mempo.agent_format import format_documents
from mempo.bm25 import LocalSearch
from mempo.schemas import Group, Round, Task, Trajectory
from mempo_cli.launcher.transcripts import (
    KINDS,
    count_failures,
    failure_kind,
    memory_values,
    write_transcripts,
)
from mempo_sim.oracle import Oracle
from mempo_sim.world import Question, World
from services.learner.sft import oracle_rounds


def _question(world: World, hops: int, relation: str | None = None) -> Question:
    return next(
        q
        for q in world.questions
        if q.hops == hops and (relation is None or q.relations[0] == relation)
    )


def _trajectory(
    tok: object, responses: list[str], answer: str | None, correct: bool = False
) -> Trajectory:
    rounds = []
    for i, text in enumerate(responses):
        ids = tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
        query = (
            text.split("<search>")[1].split("</search>")[0].strip() if "<search>" in text else None
        )
        rounds.append(Round.model_validate({
            "index": i, "prompt_ids": [1, 2], "response_ids": ids, "response_logprobs": [0.0] * len(ids),
            "action": "search" if query else "answer", "query": query, "information": "Zed\nZed is a city.",
        }))  # fmt: skip
    return Trajectory(rounds=rounds, answer_text=answer, correct=correct)


def _kind(
    world: World,
    tok: object,
    questions: list[Question],
    memories: list[str],
    answer: str | None,
    searched: list[str] | None = None,
) -> str:
    """The kind of an episode that wrote ``memories`` and searched every question's subject
    (or ``searched``) once."""
    queries = [q.subject for q in questions] if searched is None else searched
    rounds = max(len(memories), len(queries))
    pairs = [
        (memories[min(i, len(memories) - 1)], queries[i % len(queries)]) for i in range(rounds)
    ]
    responses = [f"<mem>{m}</mem>\n<think>t</think>\n<search> {q}</search>" for m, q in pairs]
    traj = _trajectory(tok, responses, answer)
    return failure_kind(world, [q.text for q in questions], traj, [m for m, _ in pairs])


def test_memory_values_reads_found_and_final_values() -> None:
    assert memory_values("Q1 = Bor; Q2: Kel > ?; Q3: ?", 3) == [
        ([], "Bor"),
        (["Kel"], None),
        ([], None),
    ]
    assert memory_values("garbage; Q9 = x; Q2 =", 2) == [([], None), ([], None)]


def test_the_failure_kinds_of_the_issue_are_told_apart(world: World, tokenizer: object) -> None:
    employer = _question(world, 1, "employer")
    two_hop = _question(world, 2)
    facts = world.facts[employer.subject]
    middle = world.facts[two_hop.subject][two_hop.relations[0]]
    both = [employer, two_hop]
    cases = [  # (memory, answer, kind)
        # the wrong relation: the city of the passage where the employer was asked
        (f"Q1 = {facts['birthplace']}; Q2: ?", "a; b", "wrong_relation"),
        # a 2-hop question stopped after its first hop
        (f"Q1 = {facts['employer']}; Q2 = {middle}", "a; b", "wrong_relation"),
        # the subject written into memory instead of the answer
        (f"Q1 = {employer.subject}; Q2: ?", "a; b", "subject_in_memory"),
        (f"Q1: ?; Q2: {two_hop.subject} > {two_hop.subject} > ?", "a; b", "subject_in_memory"),
        # one answer for two questions
        (f"Q1 = {facts['employer']}", facts["employer"], "one_answer"),
    ]
    for memory, answer, kind in cases:
        assert _kind(world, tokenizer, both, [memory], answer) == kind, memory
    # the second question lost: a made-up name searched instead of its subject
    lost = [f"Q1 = {facts['employer']}; Q2: ?"] * 2
    assert (
        _kind(world, tokenizer, both, lost, "a; b", searched=[employer.subject, "Kelwen"])
        == "unsearched"
    )
    # right memories, a wrong answer anyway; and no answer at all
    right = [f"Q1 = {facts['employer']}; Q2: ?", f"Q1 = {facts['employer']}; Q2: {middle} > ?"]
    right.append(f"Q1 = {facts['employer']}; Q2: {two_hop.subject} > {middle} > ?")  # with its subject
    assert _kind(world, tokenizer, both, right, "a; b") == "wrong_value"
    assert _kind(world, tokenizer, both, right, None) == "no_answer"
    looping = _trajectory(tokenizer, ["<mem>Q1: ?</mem>\n<search> Zed</search>"] * 3, None)
    assert failure_kind(world, [employer.text], looping, ["Q1: ?"] * 3) == "loop"
    solved = _trajectory(tokenizer, ["<mem>Q1 = x</mem>\n<answer> x</answer>"], "x", correct=True)
    assert failure_kind(world, [employer.text], solved, ["Q1 = x"]) == "correct"


def test_oracle_episodes_are_correct_and_transcribed(
    world: World, tokenizer: object, tmp_path: Path
) -> None:
    """The oracle's own episodes, counted and written as the eval writes them."""
    index, oracle = LocalSearch(world.passages), Oracle(world)
    groups = []
    for questions, answers in world.tasks("test", 2, 3, seed=1):
        rounds = oracle_rounds(tokenizer, questions, lambda q: format_documents(index.retrieve([q], 3)[0]),  # type: ignore[arg-type]
                               oracle, "memory")  # fmt: skip
        answer = (
            tokenizer.decode(rounds[-1].response_ids.tolist())
            .split("<answer>")[1]
            .split("</answer>")[0]
        )  # type: ignore[attr-defined]
        traj = Trajectory(rounds=rounds, answer_text=answer.strip(), correct=True, format_ok=True)
        task = Task(questions=questions, answers=answers, n=1)
        groups.append(
            Group(group_id=task.group_id, task=task, trajectories=[traj], policy_version=0)
        )
    counts = count_failures(world, tokenizer, groups)
    assert list(counts) == list(KINDS) and counts["correct"] == 3 and sum(counts.values()) == 3
    markdown, jsonl = write_transcripts(
        tmp_path / "t", world, tokenizer, groups[:2], "oracle, memory mode, k = 2"
    )
    text = markdown.read_text()
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["episode"], r["kind"]) for r in rows] == [(1, "correct"), (2, "correct")]
    first_round = rows[0]["rounds"][0]
    assert first_round["memory"] is not None and first_round["query"] and first_round["information"]
    assert rows[0]["rounds"][-1]["answer"] and rows[0]["questions"] == groups[0].task.questions
    assert text.count("## episode ") == 2 and "## episode 1: correct" in text
    first = groups[0]
    assert first.task.questions[0] in text and "search result:" in text
    assert tokenizer.decode(first.trajectories[0].rounds[0].response_ids.tolist()).strip() in text  # type: ignore[attr-defined]


@pytest.mark.parametrize("k", [1, 2])
def test_a_question_the_world_does_not_know_is_never_an_error(
    world: World, tokenizer: object, k: int
) -> None:
    traj = _trajectory(
        tokenizer, ["<mem>Q1 = x</mem>\n<answer> x</answer>"], "x; y"[: 1 + 3 * (k - 1)]
    )
    assert failure_kind(world, ["Who is nobody?"] * k, traj, ["Q1 = x; Q2 = y"]) == "wrong_value"
