"""The engine API: the subset of SGLang's native HTTP API an RL system uses.

Real SGLang servers and the CPU engine (services/rollout) speak it alike. Unknown keys
are ignored, as SGLang does, except inside ``sampling_params``: SGLang answers 400
``unknown field `seed`, expected one of ...`` for a key outside SGLANG_SAMPLING_FIELDS,
and so does the CPU engine. See docs/rollout.md, 'The SGLang contract (audited against
0.5.23)'; tests/contract checks these names and every body the client builds against the
sglang wheel itself.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mempo.api.text import ALL_TEXT

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="ignore")

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


class InitWeightsUpdateGroupRequest(BaseModel):
    """``/init_weights_update_group``: join the learner's weight-update group (rank 0 is
    the learner; this engine's rank is ``rank_offset``)."""

    model_config = ConfigDict(extra="ignore")

    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2, le=65536)
    group_name: str = Field(default="weight_update_group", min_length=1, max_length=200)
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(BaseModel):
    """``/update_weights_from_distributed``: the next bucket the learner broadcasts."""

    model_config = ConfigDict(extra="ignore")

    names: list[str] = Field(min_length=1, max_length=100_000)
    dtypes: list[str] = Field(min_length=1, max_length=100_000)
    shapes: list[list[Annotated[int, Field(ge=0)]]] = Field(min_length=1, max_length=100_000)
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyWeightsUpdateGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    group_name: str = "weight_update_group"


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


SGLANG_VERSION = "0.5.23"  # the audited release: the GPU image's tag and the contract test's
# sglang.api.v1.api_types.SamplingParams's keys at SGLANG_VERSION, in its order: any other
# key in sampling_params is a 400 (``unknown field``) on SGLang and on the CPU engine.
SGLANG_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)  # fmt: skip
# Keys SGLang has and the CPU engine does not implement, with the values that leave the
# samples unchanged (null always does): the CPU engine refuses any other value (400)
# instead of sampling something SGLang would not. The keys not listed here and not in
# SamplingParams change nothing the CPU engine returns (stream_interval, ...).
CPU_ENGINE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "stop_regex": ([], ""),
    "min_p": (0,),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "min_new_tokens": (0,),
    "json_schema": (),
    "regex": (),
    "ebnf": (),
    "structural_tag": (),
    "logit_bias": ({},),
    "beam_width": (0, 1),
    "watermark": (),
    "choice": ([],),
}
