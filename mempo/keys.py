"""Every Redis key of the system, in one place (docs/architecture.md, 'Redis keys').

A prefix other than ``mempo:`` lets several runs share one Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLLOUT_GROUP = "rollout"  # consumer group on the task stream
LEARNER_GROUP = "learner"  # consumer group on the group stream


@dataclass(frozen=True)
class Keys:
    prefix: str = "mempo:"

    def __post_init__(self) -> None:
        if not self.prefix or any(c.isspace() for c in self.prefix) or "*" in self.prefix:
            raise ValueError(f"invalid Redis key prefix {self.prefix!r}")

    @property
    def tasks(self) -> str:
        """Stream of Task records; consumer group "rollout"."""
        return f"{self.prefix}tasks"

    @property
    def groups(self) -> str:
        """Stream of Group records; consumer group "learner"."""
        return f"{self.prefix}groups"

    @property
    def dead(self) -> str:
        """Stream of records that could not be processed, with the reason."""
        return f"{self.prefix}dead"

    @property
    def failures(self) -> str:
        """Hash entry id -> last handling error, for the dead letter's reason."""
        return f"{self.prefix}failures"

    @property
    def policy(self) -> str:
        """Hash {version, path, updated_at}: the current weights."""
        return f"{self.prefix}policy"

    def engine(self, engine_id: str) -> str:
        """String (JSON EngineInfo) with a TTL, refreshed by the engine's heartbeat."""
        return f"{self.prefix}engines:{engine_id}"

    @property
    def engines_pattern(self) -> str:
        return f"{self.prefix}engines:*"

    @property
    def learner_state(self) -> str:
        """Hash {step, version, admitted, consumed, ...} for status and resume."""
        return f"{self.prefix}learner:state"
