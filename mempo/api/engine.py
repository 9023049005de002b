"""The engine API: the subset of SGLang's native HTTP API an RL system uses.

Real SGLang servers and the CPU engine (services/rollout) speak it alike. Unknown keys
are ignored, as SGLang does. See ../shared/reference/sglang-api.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="ignore")
from mempo.api.text import ALL_TEXT

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


    max_new_tokens: int = Field(default=128, ge=0)
    temperature: float = Field(default=1.0, ge=0.0, description="0: greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1: no top-k")
    stop: Annotated[str | list[str] | None, ALL_TEXT] = None
    stop_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1, le=1024)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return value

    def stop_strings(self) -> list[str]:
        """``stop`` as a list without empty strings."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class GenerateRequest(BaseModel):
    """Exactly one of ``text`` / ``input_ids``; a list of prompts is a batch."""

    model_config = ConfigDict(extra="ignore")

    text: Annotated[str | list[str] | None, ALL_TEXT] = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    rid: Annotated[str | list[str] | None, ALL_TEXT] = None
    stream: bool = False


class FinishReason(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None


class MetaInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str = "default"
    e2e_latency: float | None = None
    output_token_logprobs: list[list[Any]] | None = Field(
        default=None, description="[logprob, token_id, null] per output token"
    )
    input_token_logprobs: list[list[Any]] | None = Field(
        default=None, description="from logprob_start_len; entry 0 has a null logprob"
    )


class GenerateResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: str = ""
    output_ids: list[int]
    meta_info: MetaInfo


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str = Field(min_length=1)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightsResponse(BaseModel):
    success: bool
    message: str = ""
    num_paused_requests: int = 0


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: Any = None
    weight_version: str = "default"


class ServerInfo(BaseModel):
    """``GET /server_info``: SGLang returns every server argument; these are the ones we read."""

    model_config = ConfigDict(extra="allow")

    model_path: str = ""
    tokenizer_path: str | None = None
    context_length: int | None = None
    max_batch_size: int | None = None
    weight_version: str = "default"
    version: str = ""
    internal_states: list[dict[str, Any]] = Field(default_factory=list)


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    torch_empty_cache: bool = False


class ControlResponse(BaseModel):
    """The answer of ``/pause_generation`` and ``/continue_generation``."""

    message: str
    status: str = "ok"


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rid: str = ""
    abort_all: bool = False
