"""Settings of the scorer service (env prefix ``MEMPO_SCORER_``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from mempo.api.scorer import AliasPolicy
from mempo.settings import RedisSettings


class ScorerSettings(RedisSettings):
    model_config = SettingsConfigDict(
        env_prefix="MEMPO_SCORER_",
        extra="ignore",
        env_nested_delimiter="__",
        use_attribute_docstrings=True,
    )

    port: int = Field(default=8002, ge=0, le=65535)
    """TCP port to listen on."""

    model_path: str | None = None
    """HF causal LM folder to score with. Unset: the tiny model, built once under MEMPO_CACHE."""

    weight_version: str = "0"
    """Weight version reported until the first update."""

    weights_root: str | None = None
    """Weight updates must name a folder inside this one, and every file read from it must
    resolve inside it too (else 403). Unset: every weight update is refused (403)."""

    device: str = "auto"
    """auto (CUDA in bf16 when available, else CPU in fp32), cuda, cuda:N or cpu."""

    method: Literal["shared", "naive"] = "shared"
    """shared: prefix-shared scoring (one trunk forward per trajectory); naive: one plain
    forward per context, the reference."""

    alias_policy: AliasPolicy = "best"
    """Alias policy of requests that do not name one: best (max P over aliases) or first."""

    max_batch_tokens: int = Field(default=65536, ge=256)
    """Padded tokens (rows x longest row) per forward; the dynamic batcher fills up to this."""

    max_wait_ms: float = Field(default=5.0, ge=0.0)
    """How long the batcher waits for more requests after the first one of a batch."""

    max_queue: int = Field(default=256, ge=1)
    """Requests waiting for the model beyond this get 503 with Retry-After."""

    max_sequence_tokens: int = Field(default=32768, ge=16)
    """Tokens of one trajectory (prompt, transcripts and scoring branches) or one item; more: 413."""

    max_request_tokens: int = Field(default=1_048_576, ge=16)
    """Tokens of one request, all its trajectories or items together; more: 413."""

    max_trajectories: int = Field(default=1024, ge=1)
    """Trajectories of one /v1/memory-scores request (a task's group: n <= 1024); more: 413."""

    max_items: int = Field(default=4096, ge=1)
    """Items of one /v1/score request; more: 413."""

    max_text_bytes_per_token: float = Field(default=16.0, ge=1.0)
    """A trajectory or item whose strings hold more than max_sequence_tokens x this many
    UTF-8 bytes, or a request with more than max_request_tokens x this many, is refused
    (413) before it is tokenised: it could not fit (real text has a few bytes per token)."""

    max_batch_share: float = Field(default=0.25, gt=0.0, le=1.0)
    """Fair batching: one request puts at most this share of max_batch_tokens into a batch
    (a turn), even alone; its remaining rows queue behind the other requests' turns, so a
    request that comes later waits for one batch of turns, not for a whole budget of one."""

    redis_url: str | None = None  # type: ignore[assignment]
    """Redis to register with (role scorer) and to read the policy pointer from. Unset: none
    (a scorer of its own, updated by hand)."""

    engine_id: str | None = None
    """Registry id. Unset: scorer-<hostname>-<port>."""

    public_url: str | None = None
    """URL other services reach this scorer at. Unset: http://<host>:<port>."""

    heartbeat_s: float = Field(default=5.0, gt=0.0)
    """Registry heartbeat period; the registration expires after three missed beats."""
