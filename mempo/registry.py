"""What the engine registry (``mempo:engines:*``) and the policy pointer (``mempo:policy``)
hold, and the proof that a registration was written by a holder of its role's admin
token (mempo/queue.py reads and writes them)."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Literal

from pydantic import BaseModel, Field


class EngineInfo(BaseModel):
    """A registry entry: an engine (or the scorer) that receives weight updates."""

    id: str
    role: Literal["rollout", "scorer", "engine"] = "rollout"
    url: str = Field(description="base URL of the engine's SGLang-compatible API")
    weight_version: str = "0"
    started_at: float = Field(default_factory=time.time)
    worker_url: str | None = Field(default=None, description="the rollout worker's own URL, if any")
    proof: str | None = Field(
        default=None,
        description="HMAC-SHA256 of [id, role, url, worker_url] keyed with the role's admin token "
        "(registration_proof): the learner sends its token and weights only to an entry that proves it",
    )

    def signed(self, token: str | None) -> EngineInfo:
        """This entry with its proof (unchanged without a token: nothing to prove)."""
        return self.model_copy(update={"proof": registration_proof(self, token)}) if token else self

    def proven(self, token: str) -> bool:
        """The entry was written by a holder of ``token``."""
        return self.proof is not None and hmac.compare_digest(self.proof, registration_proof(self, token))


def registration_proof(info: EngineInfo, token: str) -> str:
    """What an entry's ``proof`` must be: whoever can write Redis but does not hold the
    role's admin token cannot point the learner at a URL of its own."""
    message = json.dumps([info.id, info.role, info.url, info.worker_url]).encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


class PolicyPointer(BaseModel):
    """The current policy: HF-format weights at ``path``."""

    version: int
    path: str
    updated_at: float = Field(default_factory=time.time)
