"""SGLang's /generate contract: a request becomes samples, samples become the response.

- ``text`` or ``input_ids``, single or a batch (a list); ``sampling_params`` one for all
  or one per prompt; ``rid`` a string (a batch's i-th prompt gets ``f"{rid}_{i}"``) or one
  per prompt. ``n`` > 1 gives n samples per prompt, prompt-major, and a JSON list, as
  SGLang does; each sample gets ``f"{rid}_{j}"`` (SGLang draws fresh ids) so that
  /abort_request with the request's rid (a prefix) reaches them all, and
  ``sampling_seed + j`` (SGLang would repeat one sample n times).
- A prompt that does not fit (prompt + max_new_tokens > context length) is refused with
  400 ``{"error": {"message": ...}}`` and SGLang's wording; other bad input is 400 too
  (errors.py); sampling_params keys are checked as SGLang checks them (contract.py).
- Work is bounded before it is done: more samples (prompts x n) than ``max_samples``, or
  a text prompt (or all of them) over its byte limit, is 413 before anything is
  tokenised; a token covers at least one byte, so bytes bound the tokenizer's work.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from mempo.agent_format import Tokenizer
from mempo.api.engine import (
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    MetaInfo,
    SamplingParams,
)
from mempo.service import BadInput, ServiceError, TooLarge
from services.rollout.engine.sequence import Sequence, SequenceSpec


class ContextExceeded(ServiceError):
    """Rendered as SGLang's error body (see the engine app's handler)."""

    status_code = 400


@dataclass(frozen=True)
class Limits:
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_samples: int = 1024  # prompts x n of one request
    max_prompt_bytes: int | None = None  # UTF-8 bytes of one text prompt
    max_request_text_bytes: int | None = None  # of all text prompts of one request


def _check_text_bytes(texts: list[str], limits: Limits) -> None:
    """413 for a text prompt, or all of them, over the byte limits (before tokenising)."""
    total = 0
    for i, text in enumerate(texts):
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
        total += size
        if limits.max_prompt_bytes is not None and size > limits.max_prompt_bytes:
            where = f"text[{i}]" if len(texts) > 1 else "text"
            raise TooLarge(
                f"{where}: {size} bytes exceed the limit of {limits.max_prompt_bytes} bytes "
                f"per prompt (context_length x max_text_bytes_per_token); it was not tokenised"
            )
    if limits.max_request_text_bytes is not None and total > limits.max_request_text_bytes:
        raise TooLarge(
            f"text: {total} bytes exceed the limit of {limits.max_request_text_bytes} bytes "
            "per request (max_request_text_bytes); it was not tokenised"
        )


def _prompts(
    req: GenerateRequest, tokenizer: Tokenizer, limits: Limits
) -> tuple[list[list[int]], bool]:
    """The prompts as ids, and whether the request was a batch."""
    if req.stream:
        raise BadInput("stream: the CPU engine answers whole responses only (stream: false)")
    if (req.text is None) == (req.input_ids is None):
        raise BadInput("exactly one of text / input_ids must be given")
    if req.text is not None:
        texts = req.text if isinstance(req.text, list) else [req.text]
        if not texts:
            raise BadInput("text: must not be an empty list")
        _check_samples(req, len(texts), limits)
        _check_text_bytes(texts, limits)
        prompts = []
        for text in texts:  # one over the context stops it: the rest are not tokenised
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
            _check_context(len(prompts[-1]), limits)
        return prompts, isinstance(req.text, list)
    ids: Any = req.input_ids
    if not ids:
        raise BadInput("input_ids: must not be empty")
    batch = isinstance(ids[0], list)
    _check_samples(req, len(ids) if batch else 1, limits)
    if batch:
        return [list(p) for p in ids], True
    return [list(ids)], False


def _check_samples(req: GenerateRequest, prompts: int, limits: Limits) -> None:
    """413 when the request asks for more samples (prompts x n) than one may."""
    params = req.sampling_params
    if isinstance(params, list):
        samples = sum(p.n for p in params[:prompts]) + max(0, prompts - len(params))
    else:
        samples = prompts * (params.n if params is not None else 1)
    if samples > limits.max_samples:
        raise TooLarge(
            f"sampling_params.n: {prompts} prompts x n ask for {samples} samples, over the "
            f"limit of {limits.max_samples} per request (max_samples_per_request)"
        )


def _per_prompt(value: Any, count: int, field: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise BadInput(f"{field}: {len(value)} entries for {count} prompts")
    return value


def _rids(rid: str | list[str] | None, count: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)] if batch else [rid]
    return [str(r) for r in _per_prompt(rid, count, "rid")]


def _check_context(tokens: int, limits: Limits) -> None:
    if tokens >= limits.context_length:
        raise ContextExceeded(
            f"The input ({tokens} tokens) is longer than the model's context length "
            f"({limits.context_length} tokens)."
        )


def check_prompt(prompt: list[int], params: SamplingParams, limits: Limits, where: str) -> None:
    if not prompt:
        raise BadInput(f"{where}: a prompt must have at least one token")
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise BadInput(
            f"{where}: token ids {bad[:5]} outside the vocabulary [0, {limits.vocab_size})"
        )
    _check_context(len(prompt), limits)
    total = len(prompt) + params.max_new_tokens
    if total > limits.context_length:
        raise ContextExceeded(
            f"Requested token count exceeds the model's maximum context length of "
            f"{limits.context_length} tokens. You requested a total of {total} tokens: "
            f"{len(prompt)} tokens from the input messages and {params.max_new_tokens} "
            "tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit."
        )


def _spec(
    rid: str,
    prompt: list[int],
    params: SamplingParams,
    req: GenerateRequest,
    limits: Limits,
    copy: int,
) -> SequenceSpec:
    stop_ids = frozenset(params.stop_token_ids or ())
    if not params.ignore_eos:
        stop_ids |= limits.eos_token_ids
    seed = params.sampling_seed
    return SequenceSpec(
        rid=rid,
        prompt_ids=prompt,
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=None if seed is None else seed + copy,
        stop=tuple(params.stop_strings()),
        stop_token_ids=stop_ids,
        skip_special_tokens=params.skip_special_tokens,
        no_stop_trim=params.no_stop_trim,
        return_logprob=req.return_logprob,
        logprob_start_len=req.logprob_start_len,
    )


def expand(
    req: GenerateRequest, tokenizer: Tokenizer, limits: Limits
) -> tuple[list[SequenceSpec], bool]:
    """The samples a /generate request asks for, prompt-major; True if it answers a list."""
    prompts, batch = _prompts(req, tokenizer, limits)
    params_list = _per_prompt(
        req.sampling_params or SamplingParams(), len(prompts), "sampling_params"
    )
    rids = _rids(req.rid, len(prompts), batch)
    specs: list[SequenceSpec] = []
    field = "text" if req.text is not None else "input_ids"
    for i, (prompt, params, rid) in enumerate(zip(prompts, params_list, rids, strict=True)):
        where = f"{field}[{i}]" if batch else field
        check_prompt(prompt, params, limits, where)
        if req.return_logprob and req.logprob_start_len > len(prompt):
            raise BadInput(
                f"logprob_start_len: {req.logprob_start_len} is past the end of a "
                f"{len(prompt)}-token prompt"
            )
        for copy in range(params.n):
            copy_rid = f"{rid}_{copy}" if params.n > 1 else rid
            specs.append(_spec(copy_rid, prompt, params, req, limits, copy))
    any_n = any(p.n > 1 for p in params_list)
    return specs, batch or any_n


def response(seq: Sequence) -> GenerateResponse:
    """One sample in SGLang's /generate shape."""
    spec = seq.spec
    meta = MetaInfo(
        id=spec.rid,
        finish_reason=FinishReason.model_validate(seq.finish_reason),
        prompt_tokens=len(spec.prompt_ids),
        completion_tokens=len(seq.output_ids),
        cached_tokens=0,
        weight_version=seq.weight_version,
        e2e_latency=round(seq.e2e_latency, 6),
    )
    if spec.return_logprob:
        meta.output_token_logprobs = [
            [lp, tok, None] for lp, tok in zip(seq.output_logprobs, seq.output_ids, strict=True)
        ]
        start = spec.logprob_start_len
        meta.input_token_logprobs = (
            [
                [lp, tok, None]
                for lp, tok in zip(seq.input_logprobs, spec.prompt_ids[start:], strict=False)
            ]
            if start >= 0
            else []
        )
    return GenerateResponse(text=seq.text, output_ids=seq.output_ids, meta_info=meta)
