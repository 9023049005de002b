"""Settings shared by every service, and the one way a service process starts.

Each service subclasses ``ServiceSettings`` in its own ``settings.py`` with the env
prefix ``MEMPO_<NAME>_`` (for example ``MEMPO_SCORER_PORT``); every field has a
docstring, which docs/configuration.md is generated from.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(
        extra="ignore", env_nested_delimiter="__", use_attribute_docstrings=True
    )

    host: str = "127.0.0.1"
    """Interface to bind (0.0.0.0 in containers)."""

    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port to listen on."""

    admin_token: SecretStr | None = None
    """Bearer token required on admin routes (weight updates, cache flush, pause). Unset: open."""

    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Requests with a larger body get 413."""

    log_level: str = "INFO"
    """Python logging level."""

    def admin_token_value(self) -> str | None:
        return self.admin_token.get_secret_value() if self.admin_token else None


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    for noisy in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def quiet_hub() -> None:
    """Never reach a model hub, and keep progress bars out of service logs."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def serve(app: Any, settings: ServiceSettings) -> None:
    """Run an ASGI app with uvicorn; SIGTERM/SIGINT shut it down gracefully (lifespan exit)."""
    import uvicorn

    configure_logging(settings.log_level)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=10,
    )
