"""Learner service settings: env prefix ``MEMPO_LEARNER_`` (trainer: ``MEMPO_LEARNER_TRAINER__LR``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from mempo.schemas import Mode
from mempo.settings import RedisSettings, with_preset
from services.learner.trainer_config import TrainerConfig

# Named recipes: a preset's values lie under every value given (option or variable).
PRESETS: dict[str, dict[str, Any]] = {
    # What learns on the tiny model (docs/results.md) and ``mempo up`` runs: plain GRPO on
    # 1-question tasks, 8 groups of 8 rollouts a step, 2 PPO epochs, KL to the start 0.02,
    # negative advantages scaled by 0.2, 30 steps.
    "tiny": {
        "total_steps": 30,
        "questions_per_task": [1],
        "group_size": 8,
        "batch_groups": 8,
        "max_rounds": 6,
        "max_staleness": 1,
        "trainer": {
            "lr": 3e-4,
            "warmup_steps": 0,
            "ppo_epochs": 2,
            "beta_kl": 0.02,
            "alpha": 0.0,
            "neg_adv_scale": 0.2,
        },
    },
}


class LearnerSettings(RedisSettings):
    model_config = SettingsConfigDict(env_prefix="MEMPO_LEARNER_")

    preset: Literal["tiny"] | None = None
    """A named recipe under the other settings (each one given wins): tiny is the tiny
    model's, what ``mempo up`` runs (services/learner/settings.py PRESETS)."""

    port: int = Field(default=8004, ge=0, le=65535)
    """TCP port of the status API."""

    consumer_name: str = "learner-0"
    """Consumer name on the group stream; keep it stable so a restart reads back its pending groups."""

    model_path: str | None = None
    """Initial policy (HF folder). Unset: the tiny local model (built on first use)."""

    device: str = "auto"
    """Torch device of the trainer: cpu, cuda, cuda:1 ... ; auto picks cuda when available."""

    run_dir: Path = Path("runs/learner")
    """Run folder: metrics.jsonl, and checkpoints unless checkpoint_dir is set."""

    checkpoint_dir: Path | None = None
    """Checkpoints (atomic, keep_last retention). Unset: run_dir/checkpoints."""

    weights_root: Path = Path("runs/weights")
    """Published versions live here as v{version}/ (HF safetensors); shared with every engine."""

    dataset: str = "world"
    """Task source: "world" (the synthetic world, train split) or a Search-R1 / FlashRAG file."""

    world_seed: int = 0
    """Seed of the synthetic world (must match the retrieval service's corpus)."""

    task_seed: int = 0
    """Seed of task composition; task i is the same on every restart."""

    questions_per_task: Annotated[list[int], NoDecode] = Field(default_factory=lambda: [1])
    """k, questions per task: "2", a list "1,2,4" or a range "1-3" (each task draws one)."""

    group_size: int = Field(default=4, ge=1, le=1024)
    """n, rollouts per task (one GRPO group)."""

    mode: Mode = "memory"
    """memory (MemPO) or full (full-history baseline)."""

    max_rounds: int = Field(default=8, ge=1, le=256)
    """Rounds per episode before it is cut off."""

    batch_groups: int = Field(default=4, ge=1)
    """Groups per training step."""

    max_staleness: int = Field(default=0, ge=0)
    """Versions a group may lag the learner; 0 is fully on-policy. In flight: (this + 1) * batch_groups."""

    total_steps: int = Field(default=0, ge=0)
    """Stop after this many steps (counted across restarts); 0 trains forever."""

    worker_admin_token: SecretStr | None = None
    """Bearer token of the rollout workers' admin routes: weights reach each replica's
    engine through its worker (the workers' MEMPO_ROLLOUT_ADMIN_TOKEN)."""

    scorer_admin_token: SecretStr | None = None
    """Bearer token of the scorer's admin routes (the scorer's MEMPO_SCORER_ADMIN_TOKEN)."""

    publish_timeout_s: float = Field(default=300.0, gt=0)
    """Timeout of one engine's weight update."""

    weight_sync: Literal["disk", "broadcast"] = "disk"
    """How the rollout engines get each version. disk: every engine loads the published
    folder. broadcast: the learner sends the tensors over a torch.distributed group
    (gloo on CPU, NCCL on GPU; services/learner/broadcast.py) and the engines that miss it
    load the folder; the folder is published either way (late joiners, the scorer)."""

    weight_sync_address: str = "127.0.0.1"
    """broadcast: the address the engines reach this learner at (its weight group's store)."""

    weight_sync_port: int = Field(default=0, ge=0, le=65535)
    """broadcast: the port of the weight group's store. 0: a free one for each new group
    (the engines must reach any port of the learner, as on one docker network)."""

    weight_sync_backend: Literal["gloo", "nccl"] = "gloo"
    """broadcast: the torch.distributed backend (nccl between GPUs)."""

    weight_sync_bucket_mb: float = Field(default=256.0, gt=0)
    """broadcast: MiB of tensors per bucket (one collective each)."""

    keep_versions: int = Field(default=2, ge=1)
    """Published versions kept on disk (older ones are deleted unless an engine still serves them)."""

    claim_idle_ms: int = Field(default=60_000, ge=1)
    """A group pending this long in a dead consumer is taken over."""

    max_sequence_tokens: int = Field(default=0, ge=0)
    """A round longer than this (prompt + response tokens) dead-letters its group before
    it reaches the trainer (memory grows with the square of the length); 0: the model's
    context (``max_position_embeddings``)."""

    max_deliveries: int = Field(default=3, ge=1)
    """A group delivered this many times without being trained goes to the dead stream."""

    poll_ms: int = Field(default=1000, ge=1)
    """How long one claim of the group stream blocks (the loop checks for shutdown between)."""

    keep_trained_ids: int = Field(default=100_000, ge=1)
    """Trained group ids remembered (and checkpointed) to drop duplicates."""

    exit_on_error: bool = False
    """End the process when the loop fails, so a supervisor restarts it from the latest checkpoint."""

    drain_timeout_s: float = Field(default=60.0, ge=0)
    """On shutdown, how long the running step may take to finish before it is cancelled."""

    tracking: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["jsonl"])
    """Where each step's figures go: jsonl (metrics.jsonl, always) and any of tensorboard,
    wandb, mlflow, comma separated (each needs ``pip install 'mempo[tracking]'``; W&B
    offline without an API key; docs/operations.md, 'Tracking')."""

    sample_every: int = Field(default=10, ge=0)
    """Every this many steps, decoded trajectories of the step go to
    run_dir/samples/step-<n>.jsonl and the trackers (0: never)."""

    sample_trajectories: int = Field(default=4, ge=0)
    """Trajectories decoded each time (their rounds: memory, think, query, information,
    answer, P_mem, P_full)."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The PPO trainer's configuration (services/learner/trainer_config.py)."""

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        return with_preset(data, PRESETS)

    @field_validator("tracking", mode="before")
    @classmethod
    def _parse_tracking(cls, value: Any) -> Any:
        from mempo.tracking import backend_names

        return backend_names(value)

    @field_validator("tracking")
    @classmethod
    def _check_tracking(cls, value: list[str]) -> list[str]:
        from mempo.tracking import check_backends

        return check_backends(value)

    @field_validator("questions_per_task", mode="before")
    @classmethod
    def _parse_ks(cls, value: Any) -> Any:
        return parse_ks(value) if isinstance(value, (str, int)) else value

    @field_validator("questions_per_task")
    @classmethod
    def _check_ks(cls, value: list[int]) -> list[int]:
        if not value or min(value) < 1 or max(value) > 64:
            raise ValueError("questions_per_task needs integers between 1 and 64")
        return value

    @property
    def capacity(self) -> int:
        """The in-flight bound: (max_staleness + 1) * batch_groups."""
        return (self.max_staleness + 1) * self.batch_groups

    @property
    def checkpoints(self) -> Path:
        return self.checkpoint_dir or self.run_dir / "checkpoints"

    def role_tokens(self) -> dict[str, str | None]:
        """The admin token of each registry role the learner publishes weights to."""
        return {
            "rollout": _secret(self.worker_admin_token),
            "scorer": _secret(self.scorer_admin_token),
        }

    def resolved_model_path(self) -> str:
        if self.model_path:
            return self.model_path
        from mempo_sim.tiny import default_cache_dir, ensure_tiny

        return str(ensure_tiny(default_cache_dir()))

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value else None


def parse_ks(value: str | int) -> list[int]:
    """ "2" -> [2]; "1,2,4" -> [1, 2, 4]; "1-3" -> [1, 2, 3]."""
    text = str(value).strip()
    if match := re.fullmatch(r"(\d+)\s*-\s*(\d+)", text):
        low, high = int(match.group(1)), int(match.group(2))
        if low > high:
            raise ValueError(f"questions_per_task range {text!r} is empty")
        return list(range(low, high + 1))
    try:
        return [int(part) for part in text.strip("[]").split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"questions_per_task {text!r} is not k, a list k1,k2 or a range a-b"
        ) from None
