"""SGLang's request contract for ``sampling_params``, as the CPU engine enforces it.

SGLang (>= 0.5.23) checks every /generate body against its schema
(``sglang.srt.entrypoints.api_contract.generate_contract_error``): a ``sampling_params``
key it does not know is 400 ``{"error": "unknown field `seed`, expected one of ..."}``.
The CPU engine answers the same, so a typo fails here as it would on a GPU node. A key
SGLang knows and this engine does not implement is refused too (400 naming it) unless its
value changes nothing (``CPU_ENGINE_NEUTRAL``): this engine never returns samples SGLang
would not. tests/contract/ holds the names and messages against the sglang wheel.
"""

from __future__ import annotations

from typing import Any

from mempo.api.engine import CPU_ENGINE_NEUTRAL, SGLANG_SAMPLING_FIELDS
from mempo.service import BadInput, ServiceError


class UnknownField(ServiceError):
    """A sampling_params key SGLang does not know (rendered as SGLang's ``{"error": str}``)."""

    status_code = 400


def unknown_field_message(key: str, fields: tuple[str, ...] = SGLANG_SAMPLING_FIELDS) -> str:
    """serde's ``unknown_field`` text, as sglang.api.v1.api_types words it."""
    if not fields:
        return f"unknown field `{key}`, there are no fields"
    if len(fields) == 1:
        return f"unknown field `{key}`, expected `{fields[0]}`"
    if len(fields) == 2:
        return f"unknown field `{key}`, expected `{fields[0]}` or `{fields[1]}`"
    listed = ", ".join(f"`{f}`" for f in fields)
    return f"unknown field `{key}`, expected one of {listed}"


def check_sampling_keys(body: Any) -> None:
    """The keys of every ``sampling_params`` of a /generate body (already parsed by
    GenerateRequest, so the shapes are right): UnknownField for a key SGLang refuses,
    BadInput for one this engine would ignore although it changes SGLang's samples."""
    params: Any = body.get("sampling_params") if isinstance(body, dict) else None
    batch = isinstance(params, list)
    rows: list[Any] = params if batch else [params]
    for i, one in enumerate(rows):
        if not isinstance(one, dict):
            continue
        where = f"sampling_params[{i}]" if batch else "sampling_params"
        for key, value in one.items():
            if key not in SGLANG_SAMPLING_FIELDS:
                raise UnknownField(unknown_field_message(key))
            neutral = CPU_ENGINE_NEUTRAL.get(key)
            if neutral is not None and value is not None and value not in neutral:
                allowed = ", ".join(repr(v) for v in neutral) or "nothing but null"
                raise BadInput(
                    f"{where}.{key}: not supported by the CPU engine (accepted: {allowed})"
                )
