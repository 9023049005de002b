"""The one interface every search backend has, and hybrid search by rank fusion.

A backend maps a batch of queries to, per query, up to k ``(row, score)`` pairs best
first, rows indexing the document store. ``mempo.bm25.Bm25Index`` (BM25) and
``services.retrieval.dense.DenseIndex`` (faiss) implement it; ``HybridIndex`` fuses two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

Hit = tuple[int, float]


class SearchBackend(Protocol):
    name: str
    size: int

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]: ...


def reciprocal_rank_fusion(rankings: Sequence[Sequence[Hit]], k: int, rrf_k: int = 60) -> list[Hit]:
    """Fuse ranked lists: score(row) = sum over lists of 1 / (rrf_k + rank), rank from 1.

    Ties are broken by the lower row, so the fusion is deterministic.
    """
    fused: dict[int, float] = {}
    for ranking in rankings:
        for rank, (row, _) in enumerate(ranking, start=1):
            fused[row] = fused.get(row, 0.0) + 1.0 / (rrf_k + rank)
    return sorted(fused.items(), key=lambda item: (-item[1], item[0]))[:k]


class HybridIndex:
    """Reciprocal-rank fusion of two backends over the same documents (Cormack et al. 2009)."""

    name = "hybrid"

    def __init__(
        self, sparse: SearchBackend, dense: SearchBackend, rrf_k: int = 60, depth: int = 20
    ) -> None:
        if sparse.size != dense.size:
            raise ValueError(f"backends index {sparse.size} and {dense.size} documents")
        self.sparse = sparse
        self.dense = dense
        self.size = sparse.size
        self.rrf_k = rrf_k
        self.depth = depth

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        depth = max(k, self.depth)
        sparse = self.sparse.search(queries, depth)
        dense = self.dense.search(queries, depth)
        return [
            reciprocal_rank_fusion((s, d), k, self.rrf_k)
            for s, d in zip(sparse, dense, strict=True)
        ]
