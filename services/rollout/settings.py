"""Settings of the rollout worker (env prefix ``MEMPO_ROLLOUT_``)."""

from __future__ import annotations

import os
import socket
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from mempo.rewards import RewardKind
from mempo.settings import RedisSettings, with_preset

# Named recipes: a preset's values lie under every value given (option or variable).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"max_new_tokens": 256},  # the tiny model's rounds are short (mempo up)
}


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(RedisSettings):
    model_config = SettingsConfigDict(env_prefix="MEMPO_ROLLOUT_")

    preset: Literal["tiny"] | None = None
    """A named recipe under the other settings (each one given wins): tiny is the tiny
    model's, what ``mempo up`` runs (services/rollout/settings.py PRESETS)."""

    port: int = Field(default=8003, ge=0, le=65535)
    """TCP port of the worker's HTTP API."""

    worker_id: str = Field(default_factory=default_worker_id)
    """Consumer name in the "rollout" group and id in the engine registry (default hostname-pid)."""

    engine_url: str = "http://127.0.0.1:30000"
    """Base URL of this worker's engine (SGLang, or the CPU engine)."""

    engine_admin_token: SecretStr | None = None
    """Bearer token of the engine's admin routes (the engine's own key: only this worker
    uses it; the learner updates the engine through the worker's admin route)."""

    engine_timeout_s: float = Field(default=600.0, gt=0)
    """Timeout of one engine request."""

    retrieval_url: str = "http://127.0.0.1:8001"
    """Base URL of the retrieval service (POST /retrieve)."""

    retrieval_topk: int = Field(default=3, ge=1, le=50)
    """Documents per search shown to the agent."""

    scorer_url: str = "http://127.0.0.1:8002"
    """Base URL of the scorer (P_mem / P_full). Empty: no memory scoring."""

    scorer_attempts: int = Field(default=5, ge=1, le=20)
    """Attempts per scorer call before the task is given back to the queue."""

    tokenizer_path: str | None = None
    """Tokenizer folder; default: the engine's /model_info tokenizer_path (or model_path)."""

    max_concurrent_episodes: int = Field(default=64, ge=1)
    """Episodes in flight at once on this worker, across all its tasks."""

    max_concurrent_tasks: int = Field(default=4, ge=1)
    """Tasks claimed and processed at once."""

    max_new_tokens: int = Field(default=512, ge=1)
    """Tokens the engine may generate per round."""

    temperature: float = Field(default=1.0, ge=0.0)
    """Sampling temperature (0: greedy); always sent explicitly to the engine, and carried
    in every Group: the learner recomputes log-probs at it (log_softmax(logits / T))."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling."""

    top_k: int = -1
    """Top-k sampling (-1: off)."""

    max_context_tokens: int | None = Field(default=None, ge=16)
    """Prompt + max_new_tokens limit; default: the engine's /server_info context_length."""

    reward_kind: RewardKind = "em"
    """Outcome reward: em (all sub-answers right), fraction, or f1."""

    claim_idle_ms: int = Field(default=60_000, ge=1)
    """A task pending this long on a silent worker is reclaimed by another."""

    claim_block_ms: int = Field(default=1000, ge=1, le=4000)
    """How long one claim blocks waiting for a new task (under the Redis client's 5 s
    read timeout: a longer block times out on every claim)."""

    max_deliveries: int = Field(default=3, ge=1)
    """A task delivered this many times without success goes to the dead stream."""

    heartbeat_s: float = Field(default=5.0, gt=0)
    """Interval of the registry heartbeat and of the policy check."""

    registry_ttl_s: int = Field(default=15, ge=1)
    """The registry entry expires this long after the last heartbeat (about 3x heartbeat_s)."""

    drain_timeout_s: float = Field(default=30.0, ge=0)
    """On shutdown, in-flight tasks get this long to finish before they are cancelled."""

    public_url: str | None = None
    """This worker's own URL, published in the registry: the learner calls its
    /update_weights_from_disk there. Unset: http://<host>:<port> (127.0.0.1 for 0.0.0.0)."""

    consume: bool = True
    """Run the Redis consumer loop (false, or an empty redis_url: serve /v1/episodes only)."""

    episodes_max_n: int = Field(default=64, ge=1)
    """Episodes (task.n) one POST /v1/episodes may ask for; more: 413. Tasks from the queue
    are not capped (the learner writes them)."""

    episodes_max_rounds: int = Field(default=64, ge=1)
    """task.max_rounds one POST /v1/episodes may ask for; more: 413."""

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        return with_preset(data, PRESETS)

    def engine_admin_token_value(self) -> str | None:
        return self.engine_admin_token.get_secret_value() if self.engine_admin_token else None

    def own_url(self) -> str:
        """What the registry says the learner should call (``public_url`` or host:port)."""
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"
