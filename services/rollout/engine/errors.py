"""The CPU engine's error answers where SGLang's differ from the other services'.

- Bad input (a malformed body, a wrong field, an unusable request) is 400, not 422:
  ``{"object": "error", "message": ..., "type": "Bad Request", "param": null, "code": 400}``
  as SGLang's RequestValidationError handler (``message`` names the field, as elsewhere).
- An unknown ``sampling_params`` key is 400 ``{"error": "unknown field ..."}``; a prompt
  over the context and a request id already in flight are 400 ``{"error": {"message":
  ...}}``: SGLang's two other 400 shapes.
- A missing or wrong admin token is 401 ``{"error": "Unauthorized"}`` (SGLang's
  ``utils/auth.py``; the other services answer 403 for a wrong one), with a ``message``.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from mempo.service import BadInput, Unauthorized, WrongToken, _validation_message
from services.rollout.engine.contract import UnknownField
from services.rollout.engine.protocol import ContextExceeded
from services.rollout.engine.runtime import DuplicateRequestId


def bad_request(message: str, detail: object = None) -> JSONResponse:
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None}
    return JSONResponse({**body, "code": 400, "detail": detail}, 400)


def install_sglang_errors(app: FastAPI) -> None:
    """Call after install_common: these handlers replace its 422 and 403 answers."""

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        detail = [
            {k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()[:20]
        ]
        return bad_request(_validation_message(exc), detail)

    async def on_bad_input(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, BadInput)
        return bad_request(exc.message)

    async def on_unknown_field(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, UnknownField)
        return JSONResponse({"error": exc.message}, 400)

    async def on_value_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ContextExceeded | DuplicateRequestId)
        return JSONResponse({"error": {"message": exc.message}}, 400)

    async def on_auth(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Unauthorized | WrongToken)
        headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse({"error": "Unauthorized", "message": exc.message}, 401, headers)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(BadInput, on_bad_input)
    app.add_exception_handler(UnknownField, on_unknown_field)
    app.add_exception_handler(ContextExceeded, on_value_error)
    app.add_exception_handler(DuplicateRequestId, on_value_error)
    app.add_exception_handler(Unauthorized, on_auth)
    app.add_exception_handler(WrongToken, on_auth)
