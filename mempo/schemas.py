"""Wire records shared by every service (docs/architecture.md, 'Wire records').

These pydantic models are the one contract for what travels between processes: over
HTTP as plain JSON, and through Redis where the token arrays travel packed (base64 of
little-endian int32 / float64, see mempo/arrays.py) when dumped with
``context={"pack": True}``. Validation accepts both forms, so
``Model.model_validate_json(m.model_dump_json(...)) == m`` either way.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from mempo.arrays import LogProbs, TokenIds

SCHEMA_VERSION = 2
# Versions this build reads. 2 added Group.temperature (a default keeps version-1 records
# valid: they were sampled at temperature 1, the only setting the learner could match).
READABLE_VERSIONS = (1, 2)
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (SGLang's threshold)
MAX_TEMPERATURE = 100.0  # a record sampled hotter is refused (no rollout samples there; 1e308 overflowed the learner)

Mode = Literal["memory", "full"]
Action = Literal["search", "answer", "invalid"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)
    schema_version: int = SCHEMA_VERSION

    @model_validator(mode="after")
    def _check_version(self) -> Record:
        if self.schema_version not in READABLE_VERSIONS:
            raise ValueError(
                f"schema_version {self.schema_version} is not supported "
                f"(this build reads {', '.join(map(str, READABLE_VERSIONS))})"
            )
        return self


class Task(Record):
    """One task: k questions answered together, rolled out n times (one GRPO group)."""

    task_id: str = Field(default_factory=lambda: new_id("task"), min_length=1, max_length=200)
    group_id: str = Field(default_factory=lambda: new_id("group"), min_length=1, max_length=200)
    questions: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1, max_length=64)
    answers: list[list[Annotated[str, Field(min_length=1)]]] = Field(
        min_length=1, description="gold aliases, one non-empty list per question"
    )
    n: int = Field(default=4, ge=1, le=1024, description="rollouts of this task (group size)")
    mode: Mode = "memory"
    max_rounds: int = Field(default=8, ge=1, le=256)
    score_task: bool = Field(
        default=False,
        description="also score P_task, the gold answer given the task alone (an empty memory); "
        "the learner asks when its trainer's mem_baseline is none or prev",
    )
    created_at: float = Field(default_factory=time.time)

    @model_serializer(mode="wrap")  # unannotated: a return type would hide the JSON schema's fields
    def _dump(self, handler: SerializerFunctionWrapHandler):
        """score_task is written only when true: a worker older than it (records refuse
        unknown fields) still reads the tasks of a learner that does not ask for P_task."""
        data = handler(self)
        if not self.score_task and isinstance(data, dict):
            data.pop("score_task", None)
        return data

    @model_validator(mode="after")
    def _check_answers(self) -> Task:
        if len(self.answers) != len(self.questions):
            raise ValueError(
                f"answers has {len(self.answers)} alias lists for {len(self.questions)} questions"
            )
        if any(len(aliases) == 0 for aliases in self.answers):
            raise ValueError("answers: every question needs at least one gold alias")
        return self


class Round(Record):
    """One generation of the agent: exactly the ids the engine saw and produced."""

    index: int = Field(ge=0)
    prompt_ids: TokenIds
    response_ids: TokenIds
    response_logprobs: LogProbs
    mem_span: tuple[int, int] | None = Field(
        default=None, description="[start, end) of the <mem> content in response_ids"
    )
    action: Action
    query: str | None = None
    information: str | None = Field(default=None, description="text shown to the agent next round")
    finish_reason: str = "stop"
    weight_version: str = "0"

    @model_validator(mode="after")
    def _check_lengths(self) -> Round:
        if len(self.prompt_ids) == 0:
            raise ValueError("prompt_ids is empty")
        if len(self.response_logprobs) != len(self.response_ids):
            raise ValueError(
                f"response_logprobs has {len(self.response_logprobs)} values for "
                f"{len(self.response_ids)} response_ids"
            )
        if self.mem_span is not None:
            start, end = self.mem_span
            if not 0 <= start <= end <= len(self.response_ids):
                raise ValueError(
                    f"mem_span {self.mem_span} lies outside the response ({len(self.response_ids)} tokens)"
                )
        if self.action == "search" and not self.query:
            raise ValueError("a search round needs its query")
        return self


class Trajectory(Record):
    """One episode of a task; p_mem / p_full hold one value per round with a memory."""

    trajectory_id: str = Field(default_factory=lambda: new_id("traj"))
    rounds: list[Round] = Field(min_length=1)
    answer_text: str | None = None
    reward: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="outcome reward R_T in [0, 1] (exact match; F1 and partial credit too)",
    )
    correct: bool = False
    format_ok: bool = False
    p_mem: list[float] = Field(default_factory=list)
    p_full: list[float] = Field(default_factory=list)
    p_task: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="P(gold | task, an empty memory): the same for a task's trajectories",
    )
    num_tokens: int = Field(
        default=0, ge=0, description="prompt + response tokens the engine processed"
    )

    @model_validator(mode="after")
    def _check_rounds(self) -> Trajectory:
        if [r.index for r in self.rounds] != list(range(len(self.rounds))):
            raise ValueError("rounds must be indexed 0..R-1 in order")
        if len(self.p_mem) != len(self.p_full):
            raise ValueError(
                f"p_mem has {len(self.p_mem)} values but p_full has {len(self.p_full)}"
            )
        with_memory = sum(r.mem_span is not None for r in self.rounds)
        if self.p_mem and len(self.p_mem) != with_memory:
            raise ValueError(
                f"p_mem has {len(self.p_mem)} values for {with_memory} rounds with a memory"
            )
        for name in ("p_mem", "p_full"):  # NaN fails the comparison too
            bad = next((p for p in getattr(self, name) if not 0.0 <= p <= 1.0), None)
            if bad is not None:
                raise ValueError(f"{name} holds {bad}: probabilities lie in [0, 1]")
        return self

    @property
    def memory_rewards(self) -> list[float]:
        """R_M per round with a memory: P_mem - P_full."""
        return [m - f for m, f in zip(self.p_mem, self.p_full, strict=True)]


class Group(Record):
    """The n trajectories of one task: the unit the learner trains on."""

    group_id: str
    task: Task
    trajectories: list[Trajectory] = Field(min_length=1)
    policy_version: int = Field(ge=0, description="oldest engine weight version used")
    scorer_version: str | None = None
    worker_id: str = "unknown"
    created_at: float = Field(default_factory=time.time)
    temperature: float = Field(
        default=1.0,
        ge=0.0,
        le=MAX_TEMPERATURE,
        allow_inf_nan=False,
        description="the sampling temperature of the rollouts (0: greedy); the engines' "
        "log-probs are of log_softmax(logits / T) and the learner recomputes them alike",
    )

    @property
    def logprob_temperature(self) -> float:
        """The T of the log-probs: the sampling temperature, 1 for greedy rollouts (SGLang
        and the CPU engine report a greedy token's log-prob at T = 1)."""
        return 1.0 if self.temperature < GREEDY_BELOW else self.temperature

    @model_validator(mode="after")
    def _check_group(self) -> Group:
        if self.group_id != self.task.group_id:
            raise ValueError(
                f"group_id {self.group_id!r} differs from task.group_id {self.task.group_id!r}"
            )
        if len(self.trajectories) != self.task.n:
            raise ValueError(
                f"the task asks for n={self.task.n} trajectories, the group has {len(self.trajectories)}"
            )
        return self


def parse_weight_version(value: str | int | None) -> int | None:
    """A reported weight version as one of the learner's policy versions: None and
    "default" (SGLang before any update: the base weights) are 0, "12" and "v12" are 12.
    Anything else is None: weights that are no policy version (loaded by hand), which the
    policy pointer never replaces. The one parser of the worker, the scorer and the learner."""
    if value is None or value == "default":
        return 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    text = str(value).strip().removeprefix("v")
    return int(text) if text.isascii() and text.isdigit() else None
