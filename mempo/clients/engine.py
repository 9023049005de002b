"""Client of an SGLang engine (or the CPU engine that mimics it): token in, token out.

- ``generate`` sends ``input_ids`` and explicit sampling parameters, and returns the
  exact ``output_ids`` with their log-probs. SGLang trims a matched stop string from
  ``text``; the client restores it from ``finish_reason.matched``.
- Tolerates SGLang 0.5.x route renames (``/model_info`` vs ``/get_model_info``) and
  response shapes (a list for n > 1 or a batch).
- Admin calls (weight updates, flush, pause) carry the admin bearer token.
- Retries (docs/contributing.md, 'Errors and retries'): connection errors, 5xx and 429,
  with capped backoff; a 4xx is raised at once as ``EngineError`` (``ContextExceeded``
  when the prompt does not fit).
  A retried /generate carries a fresh ``rid`` (``<rid>-r<attempt>``): SGLang keeps a
  request id taken until it notices the first attempt's disconnect (a 4 s poll) and
  answers 400 "Duplicate request ID detected" meanwhile. The ids keep the base rid as
  their prefix, so /abort_request with it still reaches every attempt.
- ``finish_reason = {type: stop, matched: "NaN happened"}`` is SGLang replacing a sampled
  token that was out of range (NaN / inf logits): ``EngineError``, never a sample.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from mempo.api.engine import GenerateResponse, ModelInfo, UpdateWeightsResponse
from mempo.clients.base import RemoteError, ServiceClient
from mempo.retry import Backoff, RetryableStatus, is_retryable_status, retry_async

log = logging.getLogger(__name__)


class EngineError(RemoteError):
    """The engine refused the request (4xx) or answered something unreadable."""


class ContextExceeded(EngineError):
    """400: prompt (+ max_new_tokens) longer than the engine's context (SGLang's wording)."""


class EngineNaN(EngineError):
    """SGLang sampled from NaN / inf logits: it replaced the token by a stop id and
    reported ``{type: stop, matched: "NaN happened"}`` (``FINISH_MATCHED_STR``)."""


NAN_MATCHED = "NaN happened"  # SGLang schedule_batch.py's marker of such a finish
_CONTEXT_PHRASES = ("context length", "longer than the model")


def _error_message(response: httpx.Response) -> str:
    """The message of SGLang's error bodies ({"error": {"message"}}, {"error": str},
    {"message"}) or of ours ({"message"}); the raw text otherwise."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "message" in body:
            return str(body["message"])
    return response.text[:500]




@dataclass(frozen=True)
class Generation:
    """One sample: exactly what the engine produced."""

    output_ids: list[int]
    logprobs: list[float]
    text: str  # with the matched stop string restored
    finish_type: str  # stop | length | abort
    matched: int | str | None
    weight_version: str
    prompt_tokens: int
    rid: str = ""
    input_logprobs: list[float | None] | None = None  # when logprob_start_len >= 0


def parse_generation(raw: dict[str, Any]) -> Generation:
    resp = GenerateResponse.model_validate(raw)
    meta = resp.meta_info
    finish = meta.finish_reason
    text = resp.text
    matched = finish.matched if finish else None
    if finish is not None and finish.type == "stop" and matched == NAN_MATCHED:
        raise EngineNaN(
            f"generation {meta.id or '?'}: the engine sampled from NaN / inf logits "
            f"(finish_reason stop, matched {NAN_MATCHED!r}); the sample is discarded"
        )
    if (
        finish is not None
        and finish.type == "stop"
        and isinstance(matched, str)
        and not text.endswith(matched)
    ):
        text += matched
    entries = meta.output_token_logprobs or []
    if entries and len(entries) != len(resp.output_ids):
        raise EngineError(f"{len(entries)} output logprobs for {len(resp.output_ids)} output ids")
    logprobs = [float(e[0]) if e and e[0] is not None else 0.0 for e in entries]
    inputs = meta.input_token_logprobs
    return Generation(
        output_ids=list(resp.output_ids),
        logprobs=logprobs,
        text=text,
        finish_type=finish.type if finish else "stop",
        matched=matched,
        weight_version=str(meta.weight_version),
        prompt_tokens=meta.prompt_tokens,
        rid=meta.id,
        input_logprobs=None if inputs is None else [e[0] if e else None for e in inputs],
    )


class EngineClient(ServiceClient):
    error = EngineError

    def __init__(
        self,
        base_url: str,
        admin_token: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        attempts: int = 3,
        client: httpx.AsyncClient | None = None,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 5.0,
    ) -> None:
        super().__init__(
            base_url,
            timeout_s=timeout_s,
            attempts=attempts,
            backoff=Backoff(base=backoff_base_s, cap=backoff_cap_s),
            client=client,
            connect_timeout_s=10.0,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        self.admin_token = admin_token

    def _admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    def _error(self, path: str, response: httpx.Response) -> EngineError:
        """SGLang's error bodies read; a prompt too long for the context: ContextExceeded."""
        message = _error_message(response)
        text = f"{path}: HTTP {response.status_code}: {message}"
        if response.status_code == 400 and any(p in message.lower() for p in _CONTEXT_PHRASES):
            return ContextExceeded(text, 400)
        return EngineError(text, response.status_code)

    async def _post(
        self, path: str, body: dict[str, Any], admin: bool = False, attempts: int | None = None
    ) -> Any:
        headers = self._admin_headers() if admin else None
        response = await self._call("POST", path, attempts, json=body, headers=headers)
        try:
            return response.json()
        except ValueError:
            return response.text

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        return_logprob: bool = True,
        rid: str | None = None,
        logprob_start_len: int | None = None,
    ) -> list[Generation]:
        """Sample from one prompt; ``sampling_params["n"]`` > 1 gives n samples.

        ``logprob_start_len`` >= 0 also returns the prompt's log-probs from there
        (``Generation.input_logprobs``, entry 0 None, as SGLang)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        if logprob_start_len is not None:
            body["logprob_start_len"] = logprob_start_len
        raw = await self._post_generate(body, rid)
        items = raw if isinstance(raw, list) else [raw]
        try:
            return [parse_generation(item) for item in items]
        except (ValueError, TypeError) as exc:
            raise EngineError(f"unreadable /generate response: {exc}") from exc

    async def _post_generate(self, body: dict[str, Any], rid: str | None) -> Any:
        """POST /generate with retries; attempt k > 0 sends ``rid`` as ``f"{rid}-r{k}"``."""
        attempt = 0

        async def once() -> httpx.Response:
            nonlocal attempt
            sent = {**body, "rid": f"{rid}-r{attempt}" if attempt else rid} if rid else body
            attempt += 1
            response = await self.http.post(f"{self.base_url}/generate", json=sent)
            if is_retryable_status(response.status_code):
                await response.aread()
                raise RetryableStatus(response)
            return response

        try:
            response = await retry_async(
                once, self.attempts, self.backoff, what=f"POST {self.base_url}/generate"
            )
        except RetryableStatus as exc:
            raise self._error("/generate", exc.response) from exc
        if response.status_code >= 400:
            raise self._error("/generate", response)
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(f"unreadable /generate response: {exc}") from exc

    async def model_info(self) -> ModelInfo:
        """``/model_info`` (SGLang >= 0.5.x), else the older ``/get_model_info``."""
        for path in ("/model_info", "/get_model_info"):
            response = await self._send("GET", path)
            if response.status_code == 404:
                continue
            if response.status_code >= 400:
                raise self._error(path, response)
            return ModelInfo.model_validate(response.json())
        raise EngineError("the engine has neither /model_info nor /get_model_info", 404)

    async def server_info(self) -> dict[str, Any]:
        """``/server_info``, else ``/get_server_info``; {} when the engine has neither."""
        for path in ("/server_info", "/get_server_info"):
            response = await self._send("GET", path)
            if response.status_code == 404:
                continue
            if response.status_code >= 400:
                raise self._error(path, response)
            return dict(response.json())
        return {}

    async def health(self) -> bool:
        try:
            response = await self.http.get(f"{self.base_url}/health", timeout=30.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str,
        abort_all_requests: bool = False,
        attempts: int = 1,
    ) -> UpdateWeightsResponse:
        body = {
            "model_path": model_path,
            "weight_version": weight_version,
            "abort_all_requests": abort_all_requests,
        }
        raw = await self._post("/update_weights_from_disk", body, admin=True, attempts=attempts)
        return UpdateWeightsResponse.model_validate(raw)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> UpdateWeightsResponse:
        """Ask the engine to join the learner's weight-update group; answers once every
        rank has joined (the learner joins at the same time, as rank 0)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        raw = await self._post("/init_weights_update_group", body, admin=True, attempts=1)
        return UpdateWeightsResponse.model_validate(raw)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str | None = None,
        group_name: str = "weight_update_group",
        load_format: str | None = "flattened_bucket",
    ) -> UpdateWeightsResponse:
        """Tell the engine what the learner broadcasts next; answers once it is loaded."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "load_format": load_format,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        raw = await self._post("/update_weights_from_distributed", body, admin=True, attempts=1)
        return UpdateWeightsResponse.model_validate(raw)

    async def destroy_weights_update_group(
        self, group_name: str = "weight_update_group"
    ) -> UpdateWeightsResponse:
        raw = await self._post(
            "/destroy_weights_update_group", {"group_name": group_name}, admin=True, attempts=1
        )
        return UpdateWeightsResponse.model_validate(raw)

    async def flush_cache(self) -> None:
        await self._post("/flush_cache", {}, admin=True)

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._post("/pause_generation", {"mode": mode}, admin=True)

    async def continue_generation(self) -> None:
        await self._post("/continue_generation", {}, admin=True)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._post("/abort_request", {"rid": rid, "abort_all": abort_all}, admin=True)
