"""What every service's HTTP app shares: errors, limits, auth, health and metrics.

- Domain exceptions (``ServiceError`` subclasses) map to HTTP codes here, in one place.
- Validation errors are 422 with a ``message`` naming the field; bodies over the limit
  413 (declared or chunked); unknown routes 404; an unexpected exception is a 500 without
  a stack trace, logged once, and the keep-alive connection stays usable.
- ``require_admin``: admin routes take ``Authorization: Bearer <token>`` when a token is
  configured (401 when missing, 403 when wrong). Tokens are never logged.
- ``/health``, ``/ready`` and ``/metrics`` (Prometheus text, one registry per app:
  mempo.metrics).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mempo.metrics import CountRequests, Metrics

if TYPE_CHECKING:
    from mempo.settings import ServiceSettings

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- errors


class ServiceError(Exception):
    status_code = 500
    headers: dict[str, str] | None = None

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if headers:
            self.headers = headers


class BadInput(ServiceError):
    status_code = 422


class Unauthorized(ServiceError):
    status_code = 401

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ServiceError):
    status_code = 403


class WrongToken(Forbidden):
    """A bearer token that is not the admin token (403; the CPU engine answers 401, as
    SGLang does)."""


class TooLarge(ServiceError):
    status_code = 413


class NotReady(ServiceError):
    status_code = 503


class Overloaded(ServiceError):
    """The service's queue is full: retry after ``retry_after`` seconds."""

    status_code = 503

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, round(retry_after)))})


class Upstream(ServiceError):
    """A service this one depends on failed."""

    status_code = 502


class ErrorBody(BaseModel):
    message: str = Field(description="what was wrong, naming the field for validation errors")
    detail: Any = None


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    async def on_service_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServiceError)
        return JSONResponse(
            ErrorBody(message=exc.message).model_dump(), exc.status_code, headers=exc.headers
        )

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        detail = [
            {k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()[:20]
        ]
        return JSONResponse(
            ErrorBody(message=_validation_message(exc), detail=detail).model_dump(), 422
        )

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return JSONResponse(
            ErrorBody(message=str(exc.detail)).model_dump(), exc.status_code, headers=exc.headers
        )

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    # Not app.add_exception_handler(Exception, ...): Starlette runs that one in its
    # outermost middleware, which answers and then re-raises, so uvicorn logs the
    # traceback a second time and closes the keep-alive connection. CatchUnexpected
    # answers instead (install_common adds it).


class CatchUnexpected:
    """ASGI middleware: an unexpected exception is logged once and answered with a JSON
    500; nothing is re-raised, so the server keeps the connection open for the next
    request. (After the response has started nothing more can be sent: the server ends
    the connection.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                body = ErrorBody(message=f"internal error: {type(exc).__name__}")
                await _send_json(send, 500, body)


# --------------------------------------------------------------------------- limits


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes`` (by Content-Length or as it streams)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)
            return message

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:  # read outside a route (a route turns it into its own 413)
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        message = f"request body exceeds the limit of {self.max_bytes} bytes"
        await _send_json(send, 413, ErrorBody(message=message))


class _BodyTooLarge(StarletteHTTPException):
    """An HTTPException, so that FastAPI's body reading passes it on as a 413 instead of
    wrapping it into 400 "There was an error parsing the body" (a chunked body, which has
    no Content-Length, is only found too large while it is read)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {max_bytes} bytes")


async def _send_json(send: Send, status: int, body: BaseModel) -> None:
    content = body.model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


# --------------------------------------------------------------------------- auth


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


CLOSED_ADMIN = (
    "the admin routes are closed: this service has no admin token (set its ADMIN_TOKEN, "
    "or ADMIN_OPEN=true for local development)"
)


def check_admin(request: Request, admin_token: str | None, admin_open: bool = False) -> None:
    """401 without a token, 403 with a wrong one; without a configured token 403 (closed),
    or open when ``admin_open``."""
    if not admin_token:
        if admin_open:
            return
        raise Forbidden(CLOSED_ADMIN)
    token = bearer_token(request)
    if token is None:
        raise Unauthorized("this route needs Authorization: Bearer <admin token>")
    if not hmac.compare_digest(token.encode(), admin_token.encode()):
        raise WrongToken("the admin token is wrong")


def require_admin(request: Request) -> None:
    """Dependency for admin routes; the token lives in ``app.state.admin_token``."""
    state = request.app.state
    check_admin(request, getattr(state, "admin_token", None), getattr(state, "admin_open", False))


AdminDep = Annotated[None, Depends(require_admin)]


def require_weights_root(root: str | Path | None) -> Path:
    """The configured weights root, resolved; 403 when there is none: a service without
    one refuses every weight update rather than load any folder it is sent."""
    if not root:
        raise Forbidden("weight updates are refused: this service has no weights root configured")
    return Path(root).expanduser().resolve()


def inside_root(path: str, root: str | Path | None) -> Path:
    """Resolve ``path`` and require it to lie inside ``root`` (403 otherwise, and 403 with
    no root; 422 for a string that names no path: a NUL byte, an unknown ``~user``).
    Only the folder is checked here: the files read from it are checked one by one
    (mempo.weights.load_checked with the root)."""
    root_resolved = require_weights_root(root)
    try:
        resolved = Path(path).expanduser().resolve()
    except (ValueError, RuntimeError, OSError) as exc:
        raise BadInput(f"model_path: not a usable path ({exc})"[:300]) from None
    if resolved != root_resolved and root_resolved not in resolved.parents:
        raise Forbidden("model_path must lie inside the weights root")
    return resolved


def without_root(text: str, root: str | Path | None) -> str:
    """``text`` (a path, or a message naming paths) with the weights root's absolute path
    written ``<weights root>``: an error body never shows where the server keeps files."""
    if not root:
        return text
    for form in sorted({str(Path(root).expanduser().resolve()), str(root).rstrip("/")}, key=len, reverse=True):
        text = text.replace(form, "<weights root>")
    return text


# --------------------------------------------------------------------------- health and metrics


class Health(BaseModel):
    status: str = "ok"
    service: str


class Readiness(BaseModel):
    ready: bool
    reason: str | None = None


def install_common(
    app: FastAPI,
    service: str,
    metrics: Metrics,
    ready: Callable[[], Awaitable[tuple[bool, str | None]]],
    settings: ServiceSettings,
) -> None:
    """Error handlers, the body limit (``settings.max_body_bytes``), request metrics and
    the /health, /ready, /metrics routes. Admin routes need ``settings.admin_token``;
    without one they are closed, or open (a warning) with ``settings.admin_open``."""
    install_error_handlers(app)
    admin_token = settings.admin_token_value()
    max_body_bytes = settings.max_body_bytes
    app.state.admin_token = admin_token or None
    app.state.admin_open = settings.admin_open and not admin_token
    if app.state.admin_open:
        log.warning(
            "%s: the admin routes are OPEN to anyone who reaches this port (no admin token, "
            "admin_open set): for local development only",
            service,
        )
    app.state.metrics = metrics
    # Innermost first. CatchUnexpected: CountRequests sees its 500s.
    app.add_middleware(CatchUnexpected)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(CountRequests, metrics=metrics)

    @app.get("/health", response_model=Health, tags=["ops"])
    async def health() -> Health:
        """Liveness: the process answers."""
        return Health(service=service)

    @app.get(
        "/ready", response_model=Readiness, tags=["ops"], responses={503: {"model": Readiness}}
    )
    async def readiness() -> Response:
        """Readiness: the service can take work (503 with the reason otherwise)."""
        ok, reason = await ready()
        return JSONResponse(Readiness(ready=ok, reason=reason).model_dump(), 200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse, tags=["ops"])
    async def prometheus() -> Response:
        """Prometheus text exposition."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
