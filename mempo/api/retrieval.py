"""Retrieval API: Search-R1's ``POST /retrieve``, field for field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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


class Document(BaseModel):
    id: str
    contents: str = Field(description='wiki-18 convention: "\\"Title\\"\\nbody"')


class ScoredDocument(BaseModel):
    document: Document
    score: float


class RetrieveResponse(BaseModel):
    result: list[list[ScoredDocument]] | list[list[Document]]


class RetrievalInfo(BaseModel):
    backend: str
    corpus_size: int
    index_build_s: float | None = None
    index_path: str | None = None
    model: str | None = None
    default_topk: int = 3
