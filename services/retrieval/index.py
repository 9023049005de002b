"""Index folders: building one from a corpus file, loading it, or indexing the built-in world.

Layout of a folder written by ``mempo retrieval build``::

    manifest.json   backend, model, corpus hash, passage count, bad lines, build time
    docs/           the document store (contents.bin + offsets; ids.* when ids are not rows)
    bm25/           bm25s arrays (memory-mapped on load) + term_max.npy    (bm25, hybrid)
    dense/          faiss.index                                            (dense, hybrid)

A build writes into a temporary sibling folder and renames it into place, so a folder
that exists is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from mempo.bm25 import Bm25Index
from mempo.files import atomic_dir
from services.retrieval.backends import HybridIndex, SearchBackend
from services.retrieval.corpus import CorpusReport, DocumentStore, DocumentWriter, read_corpus
from services.retrieval.dense import (
    DEFAULT_MODEL,
    DenseIndex,
    Encoder,
    IndexKind,
    faiss_kind,
    new_faiss_index,
)
from services.retrieval.settings import BackendName, RetrievalSettings

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
ENCODE_CHUNK = 4096  # passages per encoder call while streaming the corpus


class BadIndex(Exception):
    """An index folder or corpus that cannot be used (the message says why)."""


class Manifest(BaseModel):
    """What an index folder holds and where it came from."""

    format_version: int = FORMAT_VERSION
    backend: Literal["bm25", "dense", "hybrid"]
    model: str | None = Field(default=None, description="dense: the embedding model")
    dense_index: str | None = Field(default=None, description="dense: flat | hnsw")
    corpus: str = Field(description="the corpus file it was built from")
    corpus_sha256: str
    count: int = Field(description="passages indexed")
    lines: int = 0
    bad_lines: int = 0
    bad_examples: list[str] = Field(default_factory=list)
    build_s: float = 0.0
    created_at: float = Field(default_factory=time.time)

    @property
    def parts(self) -> set[str]:
        return {"bm25", "dense"} if self.backend == "hybrid" else {self.backend}

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST_FILE
        if not path.is_file():
            raise BadIndex(
                f"{directory} has no {MANIFEST_FILE}: build one with `mempo retrieval build`"
            )
        manifest = cls.model_validate_json(path.read_text(encoding="utf-8"))
        if manifest.format_version != FORMAT_VERSION:
            raise BadIndex(f"{path}: format_version {manifest.format_version} is not supported")
        return manifest


@dataclass
class LoadedIndex:
    """A searchable corpus: documents, the backend over them, and its provenance."""

    store: DocumentStore
    backend: SearchBackend
    manifest: Manifest
    path: Path | None = None

    @property
    def model(self) -> str | None:
        dense = getattr(self.backend, "dense", self.backend)
        encoder = getattr(dense, "encoder", None)
        return encoder.name if encoder is not None else None


# --------------------------------------------------------------------------- building


def build_index(
    corpus: Path,
    out: Path,
    backend: BackendName = "bm25",
    model: str = DEFAULT_MODEL,
    dense_index: IndexKind = "auto",
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    on_bm25: Callable[[], None] | None = None,
) -> Manifest:
    """Index a wiki-18 style jsonl file into ``out``.

    ``progress`` gets the bytes of each line read (dense passages are encoded as they
    are read); ``on_bm25`` is called once reading is done and BM25 indexing starts,
    which then shows bm25s's own progress bars.
    """
    corpus, out = Path(corpus), Path(out)
    if not corpus.is_file():
        raise BadIndex(f"corpus {corpus} is not a file")
    if out.exists() and any(out.iterdir()) and not force:
        raise BadIndex(f"{out} exists and is not empty (pass --force to replace it)")
    with atomic_dir(out, prefix=f".{out.name}-") as tmp:
        manifest = _build_into(tmp, corpus, backend, model, dense_index, progress, on_bm25)
    return manifest


def _build_into(
    tmp: Path,
    corpus: Path,
    backend: BackendName,
    model: str,
    dense_kind: IndexKind,
    progress: Callable[[int], None] | None,
    on_bm25: Callable[[], None] | None,
) -> Manifest:
    started = time.perf_counter()
    parts = {"bm25", "dense"} if backend == "hybrid" else {backend}
    report = CorpusReport()
    writer = DocumentWriter(tmp / "docs")
    contents: list[str] = []  # BM25 indexes the whole corpus at once
    dense = _StreamingDense(model, dense_kind, corpus) if "dense" in parts else None
    for doc_id, text in read_corpus(corpus, report, progress):
        writer.add(doc_id, text)
        if "bm25" in parts:
            contents.append(text)
        if dense is not None:
            dense.add(text)
    count = writer.close()
    if count == 0:
        raise BadIndex(f"{corpus}: no valid passage ({report.bad_lines} bad lines)")
    if "bm25" in parts:
        if on_bm25 is not None:
            on_bm25()
        Bm25Index.build(contents, show_progress=on_bm25 is not None).save(tmp / "bm25")
        del contents
    if dense is not None:
        dense.finish().save(tmp / "dense")
    manifest = Manifest(
        backend=backend,
        model=model if dense is not None else None,
        dense_index=faiss_kind(dense.index) if dense is not None else None,
        corpus=str(corpus.resolve()),
        corpus_sha256=report.sha256,
        count=count,
        lines=report.lines,
        bad_lines=report.bad_lines,
        bad_examples=report.bad_examples,
        build_s=round(time.perf_counter() - started, 3),
    )
    (tmp / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2), encoding="utf-8")
    log.info(
        "indexed %d passages (%d bad lines) in %.1fs", count, report.bad_lines, manifest.build_s
    )
    return manifest


class _StreamingDense:
    """Encode passages in chunks as the corpus streams by, into one faiss index."""

    def __init__(self, model: str, kind: IndexKind, corpus: Path) -> None:
        self.encoder = Encoder(model)
        expected = _count_lines(corpus) if kind == "auto" else 0
        self.index: Any = new_faiss_index(self.encoder.dim, kind, expected)
        self.pending: list[str] = []

    def add(self, text: str) -> None:
        self.pending.append(text)
        if len(self.pending) >= ENCODE_CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            self.index.add(self.encoder.passages(self.pending))  # (chunk, D)
            self.pending = []

    def finish(self) -> DenseIndex:
        self._flush()
        return DenseIndex(self.index, self.encoder)


def _count_lines(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(block.count(b"\n") for block in iter(lambda: handle.read(1 << 20), b""))


# --------------------------------------------------------------------------- loading


def load_index(path: Path, settings: RetrievalSettings) -> LoadedIndex:
    """Open an index folder for search with the backend that ``settings`` asks for."""
    manifest = Manifest.read(path)
    backend: BackendName = settings.backend or manifest.backend
    needed = {"bm25", "dense"} if backend == "hybrid" else {backend}
    if not needed <= manifest.parts:
        raise BadIndex(
            f"backend {backend!r} needs the {', '.join(sorted(needed - manifest.parts))} part "
            f"but {path} holds only {', '.join(sorted(manifest.parts))}"
        )
    store = DocumentStore.load(path / "docs", mmap=settings.mmap)
    sparse = Bm25Index.load(path / "bm25", mmap=settings.mmap) if "bm25" in needed else None
    dense = None
    if "dense" in needed:
        encoder = Encoder(
            settings.dense_model or manifest.model or DEFAULT_MODEL, settings.encode_batch_size
        )
        dense = DenseIndex.load(path / "dense", encoder, settings.mmap, settings.hnsw_ef_search)
    searcher = _combine(backend, sparse, dense, settings)
    if searcher.size != len(store):
        raise BadIndex(f"{path}: {searcher.size} indexed vectors for {len(store)} documents")
    return LoadedIndex(store, searcher, manifest, path)


def _combine(
    backend: BackendName,
    sparse: Bm25Index | None,
    dense: DenseIndex | None,
    settings: RetrievalSettings,
) -> SearchBackend:
    if backend == "hybrid":
        assert sparse is not None and dense is not None
        return HybridIndex(sparse, dense, settings.rrf_k, settings.hybrid_depth)
    searcher = sparse if backend == "bm25" else dense
    assert searcher is not None
    return searcher


def embedded_index(settings: RetrievalSettings) -> LoadedIndex:
    """Index the built-in synthetic world's passages in memory (no files, no set-up)."""
    from mempo_sim.world import World, WorldConfig

    started = time.perf_counter()
    passages = World.generate(WorldConfig(seed=settings.world_seed)).passages
    backend: BackendName = settings.backend or "bm25"
    contents = [p["contents"] for p in passages]
    sparse = Bm25Index.build(contents) if backend in ("bm25", "hybrid") else None
    dense = None
    model = settings.dense_model or DEFAULT_MODEL
    if backend in ("dense", "hybrid"):
        dense = DenseIndex.build(contents, Encoder(model, settings.encode_batch_size))
    # The hash of the file `mempo world corpus` writes for the same seed.
    digest = hashlib.sha256("".join(json.dumps(p) + "\n" for p in passages).encode())
    manifest = Manifest(
        backend=backend,
        model=model if dense is not None else None,
        dense_index="flat" if dense is not None else None,
        corpus=f"built-in world (seed {settings.world_seed})",
        corpus_sha256=digest.hexdigest(),
        count=len(passages),
        lines=len(passages),
        build_s=round(time.perf_counter() - started, 3),
    )
    store = DocumentStore.from_passages(passages)
    return LoadedIndex(store, _combine(backend, sparse, dense, settings), manifest)


def open_index(settings: RetrievalSettings) -> LoadedIndex:
    """The index the service serves: ``settings.index_path``, or the built-in world."""
    if settings.index_path is None:
        return embedded_index(settings)
    return load_index(settings.index_path, settings)
