"""Retrieval API: Search-R1's ``POST /retrieve``, field for field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class RetrieveRequest(BaseModel):
    """Search-R1's QueryRequest. Limits (count, length, topk) are the service's settings."""

    model_config = ConfigDict(extra="ignore")

    queries: list[str] = Field(min_length=1, description="one search per string")
    topk: int | None = Field(
        default=None, ge=1, description="results per query; null: the server default (3)"
    )
    return_scores: bool = Field(
        default=False, description="wrap each document as {document, score}"
    )

    @field_validator("topk", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # lax int parsing would read true as 1
            raise ValueError("topk must be an integer or null, not a boolean")
        return value


class Document(BaseModel):
    id: str
    contents: str = Field(description='wiki-18 convention: "\\"Title\\"\\nbody"')


class ScoredDocument(BaseModel):
    document: Document
    score: float


class RetrieveResponse(BaseModel):
    result: list[list[ScoredDocument]] | list[list[Document]]


class RetrievalInfo(BaseModel):
    backend: str = Field(description="bm25 | dense | hybrid")
    corpus_size: int = Field(description="passages searched")
    index_build_s: float | None = Field(default=None, description="seconds the index took to build")
    index_path: str | None = Field(default=None, description="null: the built-in world, in memory")
    model: str | None = Field(default=None, description="dense: the query embedding model")
    default_topk: int = 3
    corpus: str | None = Field(default=None, description="what was indexed")
    corpus_sha256: str | None = None
    max_queries: int | None = Field(default=None, description="most queries per request")
    max_topk: int | None = None
    max_query_chars: int | None = None
