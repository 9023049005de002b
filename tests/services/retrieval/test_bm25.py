"""mempo/bm25.py: pruned search against exhaustive bm25s scoring, persistence, recall."""

from __future__ import annotations

import itertools
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from mempo.bm25 import TERM_MAX_FILE, Bm25Index, LocalSearch, _tokenize
from mempo_sim.world import World, WorldConfig


@pytest.fixture(scope="module")
def index(world: World) -> Bm25Index:
    return Bm25Index.build([p["contents"] for p in world.passages])


def exhaustive_top_k(index: Bm25Index, query: str, k: int) -> list[tuple[int, float]]:
    """The reference: bm25s scores every document; sort by (score desc, row asc)."""
    vocab = index.model.vocab_dict
    ids = [vocab[t] for t in _tokenize([query])[0] if t in vocab]
    if not ids:
        return []
    scores = index.model.get_scores(ids)  # (N,)
    order = sorted(range(len(scores)), key=lambda row: (-scores[row], row))[:k]
    return [(row, float(scores[row])) for row in order if scores[row] > 0]


def assert_same_hits(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    assert [row for row, _ in got] == [row for row, _ in expected]
    np.testing.assert_allclose([s for _, s in got], [s for _, s in expected], rtol=1e-5)


def random_queries(world: World, seed: int, n: int) -> list[str]:
    """Mixtures of rare names, frequent words and repeats: every pruning path runs."""
    rng = random.Random(seed)
    words = " ".join(p["contents"] for p in world.passages).replace('"', " ").split()
    frequent = ["born", "city", "founded", "works", "river", "painter", "capital"]
    queries = [q.text for q in rng.sample(world.questions, n // 2)]
    while len(queries) < n:
        picked = rng.sample(words, rng.randint(1, 4)) + rng.sample(frequent, rng.randint(0, 3))
        if rng.random() < 0.3:
            picked += picked[:1]  # a repeated term counts twice, as in bm25s
        queries.append(" ".join(picked))
    return [*queries, "born city", "city city founded", "the of a"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [1, 3, 10])
def test_search_equals_exhaustive_scoring(
    index: Bm25Index, world: World, seed: int, k: int
) -> None:
    queries = random_queries(world, seed, 60)
    got = index.search(queries, k)
    for query, hits in zip(queries, got, strict=True):
        assert_same_hits(hits, exhaustive_top_k(index, query, k))


def test_pruning_is_exact_when_frequent_terms_dominate_a_small_corpus() -> None:
    # One rare term nominates 5 candidates; asking for more than 5, or for frequent
    # terms that outweigh it, leaves the answer unproven, so the search must widen.
    docs = ["alpha beta gamma"] * 40 + ["alpha beta gamma zeta"] * 3 + ["zeta"] * 2
    index = Bm25Index.build(docs)
    index.essential_df = 1  # force the pruned path on a tiny corpus
    for query in ("alpha beta gamma zeta", "alpha alpha beta zeta", "zeta", "beta"):
        for k in (3, 5, 10, 50):
            assert_same_hits(index.search([query], k)[0], exhaustive_top_k(index, query, k))


def test_postings_ascend_within_each_term(index: Bm25Index) -> None:
    """The pruned lookups binary-search posting lists: bm25s must keep rows sorted."""
    for term in range(len(index.indptr) - 1):
        column = index.indices[index.indptr[term] : index.indptr[term + 1]]
        assert np.all(np.diff(column) > 0)


def test_ties_are_broken_by_row(index: Bm25Index) -> None:
    hits = index.search(["born city"], 20)[0]
    scores = [s for _, s in hits]
    assert scores == sorted(scores, reverse=True)
    for (row_a, score_a), (row_b, score_b) in itertools.pairwise(hits):
        assert score_a > score_b or row_a < row_b


def test_queries_without_known_terms_get_nothing(index: Bm25Index) -> None:
    assert index.search(["", "the and of", "qqqzzzx"], 3) == [[], [], []]
    assert index.search([], 3) == []
    assert index.search(["born"], 0) == [[]]


def test_k_larger_than_the_corpus() -> None:
    index = Bm25Index.build(['"A"\napple pie', '"B"\nbanana pie', '"C"\ncherry'])
    hits = index.search(["pie"], 10)[0]
    assert sorted(row for row, _ in hits) == [0, 1]


def test_save_and_memory_mapped_load_round_trip(
    index: Bm25Index, world: World, tmp_path: Path
) -> None:
    index.save(tmp_path / "bm25")
    assert (tmp_path / "bm25" / TERM_MAX_FILE).exists()
    loaded = Bm25Index.load(tmp_path / "bm25", mmap=True)
    assert isinstance(loaded.data, np.memmap) or isinstance(loaded.data.base, np.memmap)
    assert loaded.size == index.size
    queries = random_queries(world, 7, 40)
    assert loaded.search(queries, 5) == index.search(queries, 5)
    # An index saved by plain bm25s (no term_max file) loads too.
    (tmp_path / "bm25" / TERM_MAX_FILE).unlink()
    plain = Bm25Index.load(tmp_path / "bm25", mmap=False)
    np.testing.assert_array_equal(plain.term_max, index.term_max)
    assert plain.search(queries, 5) == index.search(queries, 5)
    shutil.rmtree(tmp_path / "bm25")


def test_world_questions_find_the_passage_that_states_the_fact(world: World) -> None:
    search = LocalSearch(world.passages)
    one_hop = [q for q in world.questions if len(q.relations) == 1]
    results = search.retrieve([q.text for q in one_hop], topk=3)
    first_has_answer = 0
    for question, hits in zip(one_hop, results, strict=True):
        titles = [h["document"]["contents"].split("\n")[0] for h in hits]
        assert question.subject in titles, question.text
        first_has_answer += question.answers[0] in hits[0]["document"]["contents"]
    assert first_has_answer / len(one_hop) >= 0.98


def test_larger_world_still_exact(tmp_path: Path) -> None:
    worlds = [World.generate(WorldConfig(seed=seed)) for seed in range(3, 13)]  # 1,260 passages
    world = worlds[0]
    index = Bm25Index.build([p["contents"] for w in worlds for p in w.passages])
    assert index.essential_df < index.size  # frequent terms really are looked up, not scanned
    for query in random_queries(world, 3, 40):
        assert_same_hits(index.search([query], 3)[0], exhaustive_top_k(index, query, 3))


def test_searches_from_several_threads_agree(index: Bm25Index, world: World) -> None:
    from concurrent.futures import ThreadPoolExecutor

    queries = random_queries(world, 11, 80)
    chunks = [queries[i::4] for i in range(4)]
    expected = [index.search(chunk, 3) for chunk in chunks]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(3):
            assert list(pool.map(lambda chunk: index.search(chunk, 3), chunks)) == expected
