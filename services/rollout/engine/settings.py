"""Settings of the CPU engine (env prefix ``MEMPO_ENGINE_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from mempo.settings import ServiceSettings


class EngineSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="MEMPO_ENGINE_")

    port: int = Field(default=30000, ge=0, le=65535)
    """TCP port (SGLang's default, so a worker cannot tell the two apart)."""

    model_path: str | None = None
    """HF-format model folder (any causal LM). Unset: the tiny test model, built locally."""

    tokenizer_path: str | None = None
    """Tokenizer folder; default: model_path."""

    weights_root: str | None = None
    """/update_weights_from_disk only loads folders inside this root whose files all resolve
    inside it too (403 otherwise). Unset: every weight update is refused (403)."""

    weight_version: str = "0"
    """weight_version reported until the first weight update."""

    max_batch_size: int = Field(default=32, ge=1, le=4096)
    """Sequences decoded together in one forward pass."""

    max_prefill_tokens: int = Field(default=16384, ge=1)
    """Padded tokens (rows x longest prompt) of one prefill forward; admitted sequences are
    prefilled in chunks of this size (a longer prompt alone), and those whose client left
    meanwhile are dropped between chunks."""

    max_wait_ms: float = Field(default=5.0, ge=0.0)
    """How long a waiting request may wait for others to share its prefill."""

    context_length: int | None = Field(default=None, ge=2)
    """Prompt + max_new_tokens limit (400 beyond). Default: the model's max_position_embeddings."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations dtype (float32 on CPU)."""

    seed: int = 0
    """Seed of the sampler used by requests without a sampling_seed."""

    threads: int | None = Field(default=None, ge=1)
    """torch intra-op threads. Unset: torch's default."""

    drain_timeout_s: float = Field(default=10.0, ge=0.0)
    """On shutdown, in-flight requests get this long to finish before they are aborted."""

    weight_sync_timeout_s: float = Field(default=60.0, gt=0.0)
    """Joining the learner's weight-update group, and each broadcast in it, fail after this."""

    health_timeout_s: float = Field(default=20.0, gt=0.0)
    """/health_generate fails (503) when a 1-token generation takes longer than this."""

    max_samples_per_request: int = Field(default=1024, ge=1)
    """Samples one /generate may ask for (prompts x n); more: 413."""

    max_text_bytes_per_token: float = Field(default=16.0, ge=1.0)
    """A text prompt over context_length x this many UTF-8 bytes is refused (413) before it
    is tokenised: it could not fit (real text has a few bytes per token)."""

    max_request_text_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    """UTF-8 bytes of all text prompts of one /generate together; more: 413 before any is
    tokenised."""

    def resolved_model_path(self) -> Path:
        if self.model_path:
            return Path(self.model_path).expanduser().resolve()
        from mempo_sim.tiny import default_cache_dir, ensure_tiny

        return ensure_tiny(default_cache_dir())
