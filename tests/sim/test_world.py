"""The synthetic world and its oracle: determinism, split, and exact match 1.0 on real BM25."""

from __future__ import annotations

import re

import pytest

from mempo.agent_format import format_documents, parse_response
from mempo.bm25 import LocalSearch
from mempo.rewards import is_correct
from mempo_sim.oracle import Oracle
from mempo_sim.world import RELATIONS, World, WorldConfig


def test_same_seed_same_world() -> None:
    a, b = World.generate(WorldConfig(seed=3)), World.generate(WorldConfig(seed=3))
    assert a.passages == b.passages and a.questions == b.questions
    assert World.generate(WorldConfig(seed=4)).passages != a.passages


def test_corpus_is_wiki18_style(world: World) -> None:
    for p in world.passages:
        assert set(p) == {"id", "contents"}
        title, body = p["contents"].split("\n", 1)
        assert re.fullmatch(r"[A-Z][a-z]+", title) and body.startswith(f"{title} ")
    assert len({p["id"] for p in world.passages}) == len(world.passages)


def test_name_pool_is_fixed_and_of_single_words() -> None:
    from mempo_sim.lexicon import COMMON_WORDS, NAME_POOL_SIZE, NAMES, SYLLABLES, _name_pool

    assert len(NAMES) == len(set(NAMES)) == NAME_POOL_SIZE == 300
    assert _name_pool() == NAMES  # deterministic: the same on every machine
    syllables = set(SYLLABLES)
    for name in NAMES:
        lower = name.lower()
        assert name == name.capitalize() and lower not in COMMON_WORDS
        assert any(lower[:i] in syllables and lower[i:] in syllables for i in range(1, len(lower)))


def test_every_entity_is_one_pool_name_shared_across_worlds() -> None:
    from mempo_sim.lexicon import NAMES

    a, b = World.generate(WorldConfig(seed=0)), World.generate(WorldConfig(seed=1))
    for w in (a, b):
        assert set(w.kinds) <= set(NAMES) and len(w.kinds) == 126
        names = set(w.kinds)
        for q in w.questions:
            assert q.subject in names and all(x in names for x in q.answers)
    assert len(set(a.kinds) & set(b.kinds)) > 20  # the pool is shared
    assert {a.kinds[n] for n in set(a.kinds) & set(b.kinds)} != {"person"}  # in other roles too
    with pytest.raises(ValueError, match="pool names"):
        World.generate(WorldConfig(people=400))


def test_years_are_stated_but_asked_only_when_enabled() -> None:
    plain, years = World.generate(WorldConfig(seed=2)), World.generate(WorldConfig(seed=2, year_questions=True))
    assert plain.passages == years.passages
    assert any(re.search(r"\b1\d{3}\b", p["contents"]) for p in plain.passages)
    assert not any(a.isdigit() for q in plain.questions for a in q.answers)
    assert any(a.isdigit() for q in years.questions for a in q.answers)


def test_split_shares_no_question(world: World) -> None:
    train = {q.text for q in world.split_questions("train")}
    test = {q.text for q in world.split_questions("test")}
    assert train and test and not train & test
    assert {q.subject for q in world.split_questions("train")}.isdisjoint(q.subject for q in world.split_questions("test"))


def test_answers_are_not_in_the_question(world: World) -> None:
    for q in world.questions:
        assert all(a.lower() not in q.text.lower() for a in q.answers), q
    assert {q.hops for q in world.questions} == {1, 2}


def test_every_fact_is_stated_in_its_passage(world: World) -> None:
    by_title = {p["contents"].split("\n")[0]: p["contents"] for p in world.passages}
    for q in world.questions:
        subject = q.subject
        for relation in q.relations:
            value = world.extract(relation, subject, by_title[subject])
            assert value == world.facts[subject][relation], (q, relation)
            subject = value
        assert subject in q.answers


def test_tasks(world: World) -> None:
    tasks = world.tasks("test", 4, 10, seed=1)
    assert len(tasks) == 10 and tasks == world.tasks("test", 4, 10, seed=1)
    for questions, answers in tasks:
        assert len(questions) == len(answers) == 4
        assert len({world.question(q).subject for q in questions}) == 4  # type: ignore[union-attr]
    one_hop = world.tasks("train", 2, 5, max_hops=1)
    assert all(world.question(q).hops == 1 for qs, _ in one_hop for q in qs)  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        World.generate(WorldConfig(people=2, cities=2, orgs=1, countries=1)).tasks("test", 50, 1)


@pytest.mark.parametrize("mode", ["memory", "full"])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 10])
def test_oracle_exact_match_with_real_retrieval(world: World, local_search: LocalSearch, mode: str, k: int) -> None:
    oracle = Oracle(world)

    def search(query: str) -> str:
        return format_documents(local_search.retrieve([query], 3)[0])

    for questions, answers in world.tasks("test", k, 8, seed=k):
        rounds = oracle.episode(questions, search, mode=mode)
        for r in rounds:
            assert parse_response(r.response, require_memory=mode == "memory").format_ok, r.response
        final = parse_response(rounds[-1].response, require_memory=mode == "memory")
        assert final.action == "answer"
        assert is_correct(final.answer, answers), (questions, answers, final.answer)
        hops = sum(world.question(q).hops for q in questions)  # type: ignore[union-attr]
        assert len(rounds) == hops + 1  # one search per hop, then the answer


@pytest.mark.parametrize("k", [2, 3])
def test_oracle_with_subjects_keeps_each_open_subject_and_still_answers(
    world: World, local_search: LocalSearch, k: int
) -> None:
    oracle = Oracle(world, subjects=True)

    def search(query: str) -> str:
        return format_documents(local_search.retrieve([query], 3)[0])

    for questions, answers in world.tasks("test", k, 8, seed=k):
        specs = [world.question(q) for q in questions]
        rounds = oracle.episode(questions, search)
        first = parse_response(rounds[0].response).memory
        assert first == "; ".join(f"Q{i + 1}: {s.subject} > ?" for i, s in enumerate(specs))  # type: ignore[union-attr]
        final = parse_response(rounds[-1].response)
        assert is_correct(final.answer, answers), (questions, answers, final.answer)
        assert len(rounds) == sum(s.hops for s in specs) + 1  # type: ignore[union-attr]
    assert Oracle.parse_memory("Q1 = b; Q2: a > c > ?; Q3: d > ?", [2, 3, 1], subjects=True) == [
        ["b", "b"],
        ["c"],
        [],
    ]


def test_oracle_memory_carries_earlier_findings(world: World, local_search: LocalSearch) -> None:
    oracle = Oracle(world)
    questions, answers = world.tasks("test", 3, 1, seed=9)[0]
    rounds = oracle.episode(questions, lambda q: format_documents(local_search.retrieve([q], 3)[0]))
    last_memory = parse_response(rounds[-1].response).memory or ""
    for aliases in answers:
        assert aliases[0] in last_memory


def test_oracle_retries_then_gives_up(world: World) -> None:
    oracle = Oracle(world)
    questions, _ = world.tasks("test", 1, 1, seed=2)[0]
    rounds = oracle.episode(questions, lambda q: "Doc 1(Title: nothing) useless text")
    queries = [r.query for r in rounds if r.query]
    spec = world.question(questions[0])
    assert spec is not None and queries[0] == spec.subject
    assert queries[1] == f"{spec.subject} {RELATIONS[spec.relations[0]].keyword}"
    assert parse_response(rounds[-1].response).answer == "unknown"


def test_oracle_answers_rendered_prompts(world: World, local_search: LocalSearch, tokenizer: object) -> None:
    from mempo.agent_format import PreviousRound, memory_prompt_ids

    oracle = Oracle(world)
    questions, _ = world.tasks("test", 2, 1, seed=4)[0]
    info = format_documents(local_search.retrieve([world.question(questions[0]).subject], 3)[0])  # type: ignore[union-attr]
    prev = PreviousRound(memory="Q1: ?; Q2: ?", query=world.question(questions[0]).subject, information=info)  # type: ignore[union-attr]
    prompt = tokenizer.decode(memory_prompt_ids(tokenizer, questions, prev))  # type: ignore[attr-defined]
    response = oracle.respond_to_prompt(prompt, "memory")
    assert response == oracle.respond_memory(questions, prev.memory, prev.query, prev.information)
    assert "Q1: ?" not in parse_response(response).memory  # type: ignore[operator]
