"""BM25 over a passage list with bm25s (English stemmer when PyStemmer is present).

The one BM25 of the project: the retrieval service's default backend, and the local
search that the oracle's SFT data and the tests use without a server.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bm25s
import numpy as np

log = logging.getLogger(__name__)

try:  # optional: bm25s works without a stemmer, with lower recall on inflections
    import Stemmer

    _STEMMER: Any = Stemmer.Stemmer("english")
except ImportError:  # pragma: no cover - PyStemmer is a dependency
    _STEMMER = None


def _tokenize(texts: Sequence[str], show_progress: bool = False) -> list[list[str]]:
    return bm25s.tokenize(  # type: ignore[no-any-return]
        list(texts), stopwords="en", stemmer=_STEMMER, return_ids=False, show_progress=show_progress
    )


class Bm25Index:
    """Search documents ``{"id", "contents"}`` by BM25; results are (row, score) pairs."""

    def __init__(self, model: bm25s.BM25, size: int) -> None:
        self.model = model
        self.size = size

    @classmethod
    def build(cls, contents: Sequence[str], show_progress: bool = False) -> Bm25Index:
        if not contents:
            raise ValueError("cannot index an empty corpus")
        model = bm25s.BM25()
        model.index(_tokenize(contents, show_progress), show_progress=show_progress)
        return cls(model, len(contents))

    def search(self, queries: Sequence[str], k: int) -> list[list[tuple[int, float]]]:
        """Top-k (row, score) per query, best first; a query with no known term gets []."""
        k = min(k, self.size)
        tokens = _tokenize(queries)
        vocab = self.model.vocab_dict
        known = [[t for t in q if t in vocab] for q in tokens]
        results: list[list[tuple[int, float]]] = [[] for _ in queries]
        rows = [i for i, q in enumerate(known) if q]
        if not rows or k <= 0:
            return results
        docs, scores = self.model.retrieve(
            [known[i] for i in rows], k=k, show_progress=False, n_threads=0
        )
        for i, doc_row, score_row in zip(rows, np.asarray(docs), np.asarray(scores), strict=True):
            results[i] = [
                (int(d), float(s)) for d, s in zip(doc_row, score_row, strict=True) if s > 0
            ]
        return results

    def save(self, directory: Path) -> None:
        self.model.save(str(directory), show_progress=False)

    @classmethod
    def load(cls, directory: Path, mmap: bool = True) -> Bm25Index:
        model = bm25s.BM25.load(str(directory), mmap=mmap, show_progress=False, verbosity=0)
        size = int(model.scores["num_docs"]) if isinstance(model.scores, dict) else 0
        return cls(model, size)


class LocalSearch:
    """In-process search over a passage list, formatted like the retrieval service's results."""

    def __init__(self, passages: Sequence[dict[str, str]]) -> None:
        self.passages = list(passages)
        self.index = Bm25Index.build([p["contents"] for p in self.passages])

    def retrieve(self, queries: Sequence[str], topk: int = 3) -> list[list[dict[str, Any]]]:
        """Search-R1 shape: per query, ``[{"document": {"id", "contents"}, "score"}]``."""
        return [
            [{"document": self.passages[row], "score": score} for row, score in hits]
            for hits in self.index.search(queries, topk)
        ]
