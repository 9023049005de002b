"""Settings shared by every service, and the one way a service process starts.

Each service subclasses ``ServiceSettings`` in its own ``settings.py`` with the env
prefix ``MEMPO_<NAME>_`` (for example ``MEMPO_SCORER_PORT``); every field has a
docstring, which docs/configuration.md is generated from. A process that starts another
(``mempo up``) builds the child's settings object and hands it over with
``settings_env``, the inverse of reading it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from mempo.keys import Keys

NONE_TEXT = "null"  # a variable holding this sets an optional setting to None


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(
        extra="ignore",
        env_nested_delimiter="__",
        env_parse_none_str=NONE_TEXT,
        use_attribute_docstrings=True,
    )

    host: str = "127.0.0.1"
    """Interface to bind (0.0.0.0 in containers)."""

    port: int = Field(default=8000, ge=0, le=65535)
    """TCP port to listen on."""

    admin_token: SecretStr | None = None
    """Bearer token required on admin routes (weight updates, cache flush, pause). Unset:
    the admin routes answer 403, unless admin_open."""

    admin_open: bool = False
    """Without an admin token, open the admin routes to anyone who reaches the port: for
    local development only (a warning is logged at start). Ignored when a token is set."""

    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    """Requests with a larger body get 413."""

    request_read_timeout_s: float = Field(default=30.0, gt=0.0)
    """A request not fully sent (headers and body) this long after its first byte has its
    connection closed; a request fully read is never cut, however long its answer takes."""

    idle_connection_timeout_s: float = Field(default=10.0, gt=0.0)
    """A connection that has sent no byte this long after it was accepted is closed (idle
    keep-alive connections between requests close after uvicorn's 5 s)."""

    max_connections: int = Field(default=2048, ge=1)
    """Connections open at once; one more is answered at once with 503 and closed. Lowered,
    with a warning, to leave 256 file descriptors under the process's open-files limit."""

    log_level: str = "INFO"
    """Python logging level."""

    def admin_token_value(self) -> str | None:
        return self.admin_token.get_secret_value() if self.admin_token else None


class RedisSettings(ServiceSettings):
    """A service of the run's Redis (the learner, the rollout worker, the scorer): one set
    of names for its connection and keys."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis of the run: the task and group streams, the policy pointer, the engine
    registry. A password goes in redis_password."""

    redis_password: SecretStr | None = None
    """Redis password, kept out of redis_url (any characters; a password in the URL must be
    URL-quoted)."""

    key_prefix: str = "mempo:"
    """Prefix of every Redis key, so several runs can share one Redis."""

    @model_validator(mode="after")
    def _check_prefix(self) -> RedisSettings:
        Keys(self.key_prefix)  # raises on an invalid prefix
        return self

    def keys(self) -> Keys:
        return Keys(self.key_prefix)

    def redis_password_value(self) -> str | None:
        return self.redis_password.get_secret_value() if self.redis_password else None


def with_preset(data: Any, presets: Mapping[str, Mapping[str, Any]]) -> Any:
    """``data`` (the values a settings class is built from) with the preset it names in
    ``preset`` filled in under it: a value given anywhere (argument or environment) wins,
    nested blocks are merged field by field. For a ``model_validator(mode="before")``."""
    if not isinstance(data, dict) or data.get("preset") in (None, NONE_TEXT):
        return data
    name = data["preset"]
    if name not in presets:
        raise ValueError(f"unknown preset {name!r} (choose from {', '.join(presets)})")
    return merged(presets[name], data)


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` over a copy of ``base``, nested blocks (dicts, a block's model) field by field."""
    out = dict(base)
    for key, value in over.items():
        below = out.get(key)
        if isinstance(value, BaseModel):
            value = value.model_dump(exclude_unset=True)
        if isinstance(below, Mapping) and isinstance(value, Mapping):
            value = merged(below, value)
        out[key] = value
    return out


def settings_env(settings: BaseSettings) -> dict[str, str]:
    """The environment a child process reads back as ``settings``, the inverse of reading
    it: one variable per setting (``MEMPO_LEARNER_GROUP_SIZE``), a nested block's fields as
    ``<PREFIX><BLOCK>__<FIELD>``, secrets in clear (give it to that child only), None as
    ``null``."""
    prefix = str(settings.model_config.get("env_prefix", "")).upper()
    delimiter = str(settings.model_config.get("env_nested_delimiter") or "__")
    return dict(_variables(settings, prefix, delimiter))


def _variables(model: BaseModel, prefix: str, delimiter: str) -> Iterator[tuple[str, str]]:
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            yield from _variables(value, f"{prefix}{name.upper()}{delimiter}", delimiter)
        elif isinstance(value, list) and any(isinstance(m, NoDecode) or m is NoDecode for m in field.metadata):
            yield f"{prefix}{name.upper()}", ",".join(map(str, value))  # parsed by the field itself
        else:
            yield f"{prefix}{name.upper()}", _env_text(value)


def _env_text(value: Any) -> str:
    if value is None:
        return NONE_TEXT
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)
    return str(value)


def fail(message: str) -> None:
    """A command line's bad input: exit 2 with a message on stderr, never a stack trace."""
    sys.stderr.write(f"error: {message}\n")
    raise SystemExit(2)


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


MIN_SECRET_CHARS = 16
PLACEHOLDER_MARK = "change-me"  # the .env.example values


def weak_secret(settings: BaseSettings) -> str | None:
    """Why a configured secret must not be used (a placeholder, whitespace at either end, or
    too short), naming the setting and never any part of the value; None when every
    configured secret is fine.

    Secrets are the SecretStr fields and the password inside a ``*redis_url``."""
    prefix = str(settings.model_config.get("env_prefix", ""))
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        where = f"{prefix}{name}".upper()
        if isinstance(value, SecretStr):
            secret: str | None = value.get_secret_value()
        elif isinstance(value, str) and name.endswith("redis_url") and value:
            if _misquoted(value):
                return (
                    f"{where}: the password in it is not URL-quoted (/ # ? @ : must be %2F %23 "
                    f"%3F %40 %3A), or set it apart in {where.removesuffix('URL')}PASSWORD"
                )
            secret = _url_password(value)
        else:
            continue
        if not secret:
            continue
        if PLACEHOLDER_MARK in secret.lower():
            return f"{where} holds a placeholder ({PLACEHOLDER_MARK}-...): set a long random value"
        if secret != secret.strip():  # "               x" passed the length rule
            return f"{where}: a secret must not start or end with whitespace"
        if len(secret) < MIN_SECRET_CHARS:
            return f"{where}: a secret needs at least {MIN_SECRET_CHARS} characters"
    return None


def _misquoted(url: str) -> bool:
    """An ``@`` after the host part: a password with / # ? cut the URL short."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return True
    return "@" in parts.path + parts.query + parts.fragment


def _url_password(url: str) -> str | None:
    try:
        password = urlsplit(url).password
    except ValueError:
        return None  # the Redis client refuses it, with a message that shows no part of it
    return unquote(password) if password is not None else None


def refuse_weak_secrets(settings: BaseSettings) -> None:
    """Exit 2 with one line on stderr when ``weak_secret`` finds a problem."""
    problem = weak_secret(settings)
    if problem:
        fail(problem)


def unknown_variables(settings: BaseSettings, environ: dict[str, str] | None = None) -> list[str]:
    """Variables with this service's prefix that name no setting (a typo, or a setting
    renamed since), each with the closest setting's name when there is one."""
    import difflib

    prefix = str(settings.model_config.get("env_prefix", "")).upper()
    fields = {name.upper() for name in type(settings).model_fields}
    found = []
    for key in sorted(environ if environ is not None else os.environ):
        name = key[len(prefix) :].partition("__")[0] if prefix and key.startswith(prefix) else None
        if name and name not in fields:
            close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
            found.append(f"{key}" + (f" (did you mean {prefix}{close[0]}?)" if close else ""))
    return found


def serve(app: Any, settings: ServiceSettings) -> None:
    """Run an ASGI app with uvicorn; SIGTERM/SIGINT shut it down gracefully (lifespan exit).
    A placeholder or short secret ends the process first (exit 2). Connections are guarded
    (mempo.httpserver): idle and half-sent ones are closed, those beyond max_connections
    refused with 503, and the soft open-files limit is raised to the hard one."""
    import uvicorn

    from mempo.httpserver import fit_connection_limit, guarded_protocol, install_accept_error_filter

    refuse_weak_secrets(settings)
    configure_logging(settings.log_level)
    install_accept_error_filter()
    for unknown in unknown_variables(settings):
        logging.getLogger("mempo.settings").warning("ignored: %s is not a setting", unknown)
    protocol = guarded_protocol(
        settings.request_read_timeout_s,
        settings.idle_connection_timeout_s,
        fit_connection_limit(settings.max_connections),
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=10,
        http=protocol,
    )
