"""Scorer API: P_mem / P_full of an agent's memories, and generic answer log-probs.

P = exp(mean log-prob of the gold answer's tokens given a context), the geometric mean
of the token probabilities (docs/architecture.md, 'The algorithm'). Contexts are
rendered by mempo/agent_format.py, the definition the rollout workers use.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mempo.api.text import ALL_TEXT, Text

AliasPolicy = Literal["best", "first"]


class ChatMessage(BaseModel):
    role: str = Field(min_length=1)
    content: str


class ScoreItem(BaseModel):
    context: Annotated[str | list[ChatMessage], ALL_TEXT] = Field(
        description="plain text, or chat messages rendered with the model's chat template "
        "(with the generation prompt)"
    )
    answers: list[Text] = Field(
        min_length=1, description="answer aliases; the best (or first) is reported"
    )

    @model_validator(mode="after")
    def _non_empty(self) -> ScoreItem:
        if any(not a.strip() for a in self.answers):
            raise ValueError("answers: every alias must be non-empty")
        if isinstance(self.context, list) and not self.context:
            raise ValueError("context: the message list is empty")
        return self


class ScoreRequest(BaseModel):
    items: list[ScoreItem] = Field(min_length=1)
    alias_policy: AliasPolicy | None = Field(
        default=None, description="best (max P over aliases) or first; null: the server's default"
    )


class ItemScore(BaseModel):
    answer: str = Field(description="the alias the numbers refer to")
    logprob_sum: float
    logprob_mean: float
    num_tokens: int = Field(description="answer tokens scored")
    p: float = Field(description="exp(logprob_mean)")
    context_tokens: int


class ScoreResponse(BaseModel):
    scores: list[ItemScore]
    weight_version: str


class MemoryRound(BaseModel):
    memory: Text | None = Field(description="the <mem> content written in this round (null: none)")
    transcript: Text = Field(
        description="the round as full history holds it: response + information block"
    )


class MemoryTrajectory(BaseModel):
    questions: list[Text] = Field(min_length=1)
    answers: list[list[Text]] = Field(min_length=1, description="gold aliases per question")
    rounds: list[MemoryRound] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> MemoryTrajectory:
        if len(self.answers) != len(self.questions):
            raise ValueError(
                f"answers: {len(self.answers)} alias lists for {len(self.questions)} questions"
            )
        if any(not aliases or any(not a.strip() for a in aliases) for aliases in self.answers):
            raise ValueError("answers: every question needs non-empty aliases")
        return self


class MemoryScoresRequest(BaseModel):
    """One trajectory ({questions, answers, rounds}) or many ({trajectories: [...]})."""

    model_config = ConfigDict(extra="forbid")

    trajectories: list[MemoryTrajectory] = Field(min_length=1)
    alias_policy: AliasPolicy | None = Field(
        default=None, description="best (max P over aliases) or first; null: the server's default"
    )
    task_score: bool = Field(
        default=False,
        description="also P_task of each trajectory: the gold answer given the task alone (the "
        "memory context with an empty memory), scored once per distinct task of the request",
    )

    @model_validator(mode="before")
    @classmethod
    def _single(cls, data: Any) -> Any:
        if isinstance(data, dict) and "trajectories" not in data and "rounds" in data:
            single = {k: data[k] for k in ("questions", "answers", "rounds") if k in data}
            rest = {k: v for k, v in data.items() if k not in ("questions", "answers", "rounds")}
            return {"trajectories": [single], **rest}
        return data


class RoundScore(BaseModel):
    index: int
    p_mem: float | None = Field(
        description="P(gold | task + this round's memory); null without a memory"
    )
    p_full: float = Field(description="P(gold | task + full history of the earlier rounds)")
    reward: float | None = Field(description="R_M = p_mem - p_full; null without a memory")
    mem_context_tokens: int | None
    full_context_tokens: int


class TrajectoryScores(BaseModel):
    rounds: list[RoundScore]
    candidates: list[str] = Field(
        description="gold answer strings scored (agent_format.answer_candidates); with the "
        "'best' policy p_mem and p_full each take the max over them"
    )
    p_task: float | None = Field(
        default=None, description="P(gold | task + an empty memory); null unless task_score"
    )


class MemoryScoresResponse(BaseModel):
    results: list[TrajectoryScores]
    weight_version: str
