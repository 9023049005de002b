"""BM25 over a passage list with bm25s (English stemmer when PyStemmer is present).

The one BM25 of the project: the retrieval service's default backend, and the local
search that the oracle's SFT data and the tests use without a server.

bm25s builds the index (tokenise, stem, precompute every (term, doc) score into a CSC
matrix) and saves/loads it (memory-mapped). Search is ours: bm25s scores every document
of the corpus per query and selects the top k with ``argpartition`` over all of them,
which costs O(N) per query and is slow on the ties that frequent terms create. We keep
its exact scores but prune like MaxScore: the rare ("essential") query terms nominate
candidate documents, the frequent ones are only looked up for those candidates, and the
answer is accepted when the k-th candidate's full score beats the most that the frequent
terms alone could give a document outside the candidates. Otherwise the next most
valuable term joins the essential set, which ends at the exhaustive answer.
Ties are broken by row (lower first), so results are deterministic.

Glossary: N documents, V vocabulary terms, P postings (nonzero (term, doc) scores).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bm25s
import numpy as np

log = logging.getLogger(__name__)
logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets DEBUG on import

try:  # optional: bm25s works without a stemmer, with lower recall on inflections
    import Stemmer
except ImportError:  # pragma: no cover - PyStemmer is a dependency
    Stemmer = None

TERM_MAX_FILE = "term_max.npy"
Hit = tuple[int, float]
_PER_THREAD = threading.local()  # a PyStemmer object must not be shared between threads


def _stemmer() -> Any:
    if Stemmer is None:  # pragma: no cover
        return None
    if not hasattr(_PER_THREAD, "stemmer"):
        _PER_THREAD.stemmer = Stemmer.Stemmer("english")
    return _PER_THREAD.stemmer


def _tokenize(texts: Sequence[str], show_progress: bool = False) -> list[list[str]]:
    return bm25s.tokenize(  # type: ignore[no-any-return]
        list(texts),
        stopwords="en",
        stemmer=_stemmer(),
        return_ids=False,
        show_progress=show_progress,
    )


def term_max_scores(data: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """(V,) the largest score of each term over all documents (0 for an unused term)."""
    df = np.diff(indptr)  # (V,)
    out = np.zeros(len(df), dtype=np.float32)
    used = df > 0
    if used.any():
        # Empty columns hold no data, so the starts of the used ones delimit exactly them.
        out[used] = np.maximum.reduceat(np.asarray(data), np.asarray(indptr[:-1])[used])
    return out


class Bm25Index:
    """Search documents ``{"id", "contents"}`` by BM25; results are (row, score) pairs."""

    name = "bm25"

    def __init__(self, model: bm25s.BM25, size: int, term_max: np.ndarray | None = None) -> None:
        self.model = model
        self.size = size
        self.data: np.ndarray = model.scores["data"]  # (P,) score of each posting
        # (P,) doc rows, ascending within each term (bm25s sorts postings by (term, row))
        self.indices: np.ndarray = model.scores["indices"]
        self.indptr: np.ndarray = np.asarray(model.scores["indptr"])  # (V+1,)
        self.term_max = (
            term_max if term_max is not None else term_max_scores(self.data, self.indptr)
        )  # (V,)
        # bm25l/bm25+ add a per-term score to documents that lack the term; lucene has none.
        self.nonoccurrence: np.ndarray | None = getattr(model, "nonoccurrence_array", None)
        # Posting lists longer than this are looked up for candidates, not scanned.
        self.essential_df = max(1024, size // 16)

    @classmethod
    def build(cls, contents: Sequence[str], show_progress: bool = False) -> Bm25Index:
        if not contents:
            raise ValueError("cannot index an empty corpus")
        model = bm25s.BM25()
        model.index(_tokenize(contents, show_progress), show_progress=show_progress)
        return cls(model, len(contents))

    # ----------------------------------------------------------------- search

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """Top-k (row, score) per query, best first; a query with no known term gets []."""
        k = min(k, self.size)
        results: list[list[Hit]] = [[] for _ in queries]
        if k <= 0 or not queries:
            return results
        vocab = self.model.vocab_dict
        for i, tokens in enumerate(_tokenize(queries)):
            ids = [vocab[t] for t in tokens if t in vocab]
            if ids:
                results[i] = self.top_k(ids, k)
        return results

    def top_k(self, term_ids: Sequence[int], k: int) -> list[Hit]:
        """The k best documents for a query given as term ids (repeats count, as in bm25s)."""
        terms, weights = np.unique(np.asarray(term_ids, dtype=np.int64), return_counts=True)
        df = self.indptr[terms + 1] - self.indptr[terms]  # (Q,)
        impact = self.term_max[terms].astype(np.float64) * weights  # (Q,) max contribution
        essential = (df <= self.essential_df) | (df == df.min())  # (Q,) bool
        while True:
            rows, scores = self._accumulate(terms[essential], weights[essential])
            rest = ~essential
            for term, weight in zip(terms[rest], weights[rest], strict=True):
                scores += weight * self._lookup(int(term), rows)
            best = _best(rows, scores, k)
            outside_bound = float(impact[rest].sum())
            if not rest.any() or (len(best) == k and scores[best[-1]] > outside_bound):
                break
            # Not provably exact: scan the most valuable remaining term too.
            essential[np.flatnonzero(rest)[np.argmax(impact[rest])]] = True
        shift = 0.0 if self.nonoccurrence is None else float(self.nonoccurrence[terms] @ weights)
        return [(int(rows[j]), float(scores[j]) + shift) for j in best if scores[j] > 0]

    def _accumulate(self, terms: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows touched by ``terms`` (ascending) and their summed scores over those terms."""
        spans = [(int(self.indptr[t]), int(self.indptr[t + 1])) for t in terms]
        rows = np.concatenate([self.indices[s:e] for s, e in spans])  # (P_q,)
        values = np.concatenate(
            [
                self.data[s:e].astype(np.float64) * w
                for (s, e), w in zip(spans, weights, strict=True)
            ]
        )  # (P_q,)
        if len(spans) == 1:
            return rows.astype(np.int64), values
        if len(rows) > self.size // 8:  # dense accumulation beats sorting a large union
            dense = np.bincount(rows, weights=values, minlength=self.size)  # (N,)
            touched = np.flatnonzero(dense)
            return touched, dense[touched]
        touched, inverse = np.unique(rows, return_inverse=True)
        return touched.astype(np.int64), np.bincount(inverse, weights=values)

    def _lookup(self, term: int, rows: np.ndarray) -> np.ndarray:
        """(len(rows),) the term's score in each of ``rows`` (0 where it does not occur)."""
        start, end = int(self.indptr[term]), int(self.indptr[term + 1])
        if start == end:
            return np.zeros(len(rows))
        column = self.indices[start:end]
        pos = np.minimum(np.searchsorted(column, rows), len(column) - 1)
        found = column[pos] == rows
        return np.where(found, self.data[start + pos], 0).astype(np.float64)

    # ----------------------------------------------------------------- persistence

    def save(self, directory: Path) -> None:
        self.model.save(str(directory), show_progress=False)
        np.save(Path(directory) / TERM_MAX_FILE, self.term_max)

    @classmethod
    def load(cls, directory: Path, mmap: bool = True) -> Bm25Index:
        model = bm25s.BM25.load(str(directory), mmap=mmap, show_progress=False, verbosity=0)
        size = int(model.scores["num_docs"])
        cached = Path(directory) / TERM_MAX_FILE
        term_max = np.load(cached) if cached.exists() else None
        return cls(model, size, term_max)


def _best(rows: np.ndarray, scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k highest scores, best first, ties by lower row."""
    if len(scores) > k:
        chosen = np.argpartition(-scores, k - 1)[:k]
        # Equal scores at the cut may continue past it: keep them, then cut after sorting.
        chosen = np.flatnonzero(scores >= scores[chosen].min())
    else:
        chosen = np.arange(len(scores))
    order = np.lexsort((rows[chosen], -scores[chosen]))
    return chosen[order][:k]


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
