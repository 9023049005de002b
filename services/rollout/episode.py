"""One episode of a task: the agent loop of docs/rollout.md, 'The agent format', token-exact.

Every round: render the prompt ids (mempo.next_prompt: memory mode, task + the previous
round only; full mode, the previous prompt + response + information ids appended),
generate, decode the output ids (the authoritative text), parse, search, and record
exactly the ids the engine saw and produced with their log-probs. Text is never
re-tokenised into a prompt that the engine already saw as ids.

A prompt that would not fit the engine's context ends the episode cleanly with a last
round whose finish_reason is "context" (its prompt as it would have been sent, an empty
response); format_ok stays as it was and the reward is 0 (there is no answer).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mempo.agent_format import (
    DEFAULT_TAGS,
    ParsedResponse,
    Tags,
    Tokenizer,
    mem_token_span,
    memory_prompt_ids,
    parse_response,
)
from mempo.arrays import LogProbs, TokenIds
from mempo.clients.engine import ContextExceeded, EngineError, Generation
from mempo.next_prompt import next_prompt_ids
from mempo.rewards import RewardKind, is_correct, outcome_reward
from mempo.schemas import Round, Task, Trajectory, new_id
from services.rollout.metrics import WorkerMetrics

if TYPE_CHECKING:
    from services.rollout.settings import WorkerSettings

log = logging.getLogger(__name__)

CONTEXT = "context"  # finish_reason of the round that did not fit
ABORT_ATTEMPTS = 3  # an engine abort (weight update, pause) is retried, not blamed on the policy
LOGPROB_FLOOR = -1e4  # stands in for a non-finite log-prob so the record stays valid


class Generator(Protocol):
    """What the episode needs from an engine (mempo.clients.engine.EngineClient)."""

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any],
        return_logprob: bool = True,
        rid: str | None = None,
    ) -> list[Generation]: ...


class Searcher(Protocol):
    """What the episode needs from retrieval (mempo.clients.retrieval.RetrievalClient)."""

    async def search(self, query: str, topk: int | None = None) -> str: ...


@dataclass(frozen=True)
class EpisodeConfig:
    max_new_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_context_tokens: int = 32768
    topk: int = 3
    reward_kind: RewardKind = "em"
    tags: Tags = DEFAULT_TAGS

    @classmethod
    def of(cls, settings: WorkerSettings, max_context_tokens: int) -> EpisodeConfig:
        """The worker's episodes: its sampling, retrieval and reward settings, and the
        context length of its engine."""
        return cls(
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            max_context_tokens=max_context_tokens,
            topk=settings.retrieval_topk,
            reward_kind=settings.reward_kind,
        )

    def sampling_params(self, stop_token_ids: list[int]) -> dict[str, Any]:
        """Sent explicitly every time: SGLang otherwise takes the model's defaults."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.tags.stop_strings(),
            "stop_token_ids": stop_token_ids,
            "skip_special_tokens": True,
            "n": 1,
        }


@dataclass
class EpisodeResult:
    """A finished episode; the trajectory is built once p_mem / p_full are known."""

    rounds: list[Round] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # decoded response per round ("" for context)
    memories: list[str | None] = field(default_factory=list)  # <mem> content if mem_span, else None
    answer_text: str | None = None
    format_ok: bool = True  # until a round breaks the format
    reward: float = 0.0
    correct: bool = False
    num_tokens: int = 0
    trajectory_id: str = field(default_factory=lambda: new_id("traj"))

    @property
    def outcome(self) -> str:
        last = self.rounds[-1]
        if last.finish_reason == CONTEXT:
            return CONTEXT
        if not self.format_ok:
            return "invalid"
        return "correct" if self.correct else "wrong"

    def trajectory(self, p_mem: Sequence[float] = (), p_full: Sequence[float] = ()) -> Trajectory:
        return Trajectory(
            trajectory_id=self.trajectory_id,
            rounds=self.rounds,
            answer_text=self.answer_text,
            reward=self.reward,
            correct=self.correct,
            format_ok=self.format_ok,
            p_mem=list(p_mem),
            p_full=list(p_full),
            num_tokens=self.num_tokens,
        )


class EpisodeRunner:
    """Runs episodes against one engine and one retriever; safe to share across tasks."""

    def __init__(
        self,
        engine: Generator,
        searcher: Searcher,
        tokenizer: Tokenizer,
        config: EpisodeConfig,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.searcher = searcher
        self.tok = tokenizer
        self.config = config
        self.metrics = metrics or WorkerMetrics()
        eos = getattr(tokenizer, "eos_token_id", None)
        self._params = config.sampling_params([int(eos)] if eos is not None else [])
        self.engine_version = "0"  # the engine's weight_version as last seen

    async def run(self, task: Task) -> EpisodeResult:
        memory_mode = task.mode == "memory"
        result = EpisodeResult()
        prompt = memory_prompt_ids(self.tok, task.questions, None, self.config.tags)
        self.metrics.episode_started()
        outcome: str | None = None
        try:
            for index in range(task.max_rounds):
                if len(prompt) + self.config.max_new_tokens > self.config.max_context_tokens:
                    self._end_by_context(result, index, prompt)
                    break
                try:
                    round_, parsed, text = await self._round(index, prompt, result.trajectory_id, memory_mode)
                except ContextExceeded as exc:  # the engine's context is smaller than ours
                    log.info("the engine refused a %d-token prompt: %s", len(prompt), exc)
                    self._end_by_context(result, index, prompt)
                    break
                self._record(result, round_, parsed, text)
                if parsed.action != "search":
                    result.format_ok = parsed.action == "answer"
                    result.answer_text = parsed.answer
                    break
                prompt = next_prompt_ids(
                    self.tok, task.questions, round_, parsed, memory_mode, self.config.tags
                )
            else:
                result.format_ok = False  # max_rounds without an answer
            self._finish(result, task)
            outcome = result.outcome
            return result
        finally:
            self.metrics.episode_finished(task.mode, outcome)

    async def _round(
        self, index: int, prompt: list[int], trajectory_id: str, memory_mode: bool
    ) -> tuple[Round, ParsedResponse, str]:
        started = time.perf_counter()
        gen = await self._generate(prompt, f"{trajectory_id}-{index}")
        text = self.tok.decode(gen.output_ids, skip_special_tokens=True)
        parsed = parse_response(_through_stop(text, gen), self.config.tags, require_memory=memory_mode)
        information = None
        if parsed.action == "search":
            assert parsed.query is not None
            information = await self.searcher.search(parsed.query, self.config.topk)
        mem_span = mem_token_span(self.tok, gen.output_ids, text, parsed.mem_chars)
        round_ = Round(
            index=index,
            prompt_ids=TokenIds(prompt),
            response_ids=TokenIds(gen.output_ids),
            response_logprobs=LogProbs(_sanitize(gen.logprobs)),
            mem_span=mem_span,
            action=parsed.action,
            query=parsed.query,
            information=information,
            finish_reason=gen.finish_type,
            weight_version=gen.weight_version,
        )
        self.metrics.round_done(
            parsed.action, len(prompt), len(gen.output_ids), time.perf_counter() - started
        )
        return round_, parsed, text

    async def _generate(self, prompt: list[int], rid: str) -> Generation:
        for _ in range(ABORT_ATTEMPTS):
            generations = await self.engine.generate(prompt, self._params, True, rid)
            if len(generations) != 1:
                raise EngineError(f"expected 1 generation, got {len(generations)}")
            gen = generations[0]
            if len(gen.logprobs) != len(gen.output_ids):
                raise EngineError(
                    f"{len(gen.logprobs)} log-probs for {len(gen.output_ids)} output ids"
                )
            self.engine_version = gen.weight_version
            if gen.finish_type != "abort":
                return gen
            log.info("generation %s was aborted by the engine; retrying", rid)
        raise EngineError(f"generation {rid} aborted {ABORT_ATTEMPTS} times")

    def _record(self, result: EpisodeResult, round_: Round, parsed: ParsedResponse, text: str) -> None:
        result.rounds.append(round_)
        result.texts.append(text)
        result.memories.append(parsed.memory if round_.mem_span is not None else None)
        result.num_tokens += len(round_.prompt_ids) + len(round_.response_ids)

    def _end_by_context(self, result: EpisodeResult, index: int, prompt: list[int]) -> None:
        version = result.rounds[-1].weight_version if result.rounds else self.engine_version
        round_ = Round(
            index=index,
            prompt_ids=TokenIds(prompt),
            response_ids=TokenIds(),
            response_logprobs=LogProbs(),
            action="invalid",
            finish_reason=CONTEXT,
            weight_version=version,
        )
        result.rounds.append(round_)
        result.texts.append("")
        result.memories.append(None)

    def _finish(self, result: EpisodeResult, task: Task) -> None:
        result.correct = result.format_ok and is_correct(result.answer_text, task.answers)
        result.reward = outcome_reward(
            result.answer_text, task.answers, result.format_ok, self.config.reward_kind
        )


def _through_stop(text: str, gen: Generation) -> str:
    """The text up to the stop string that ended generation. Its last token may carry more
    (a token such as ``>.``); that is the engine's doing, not a format error."""
    if gen.finish_type == "stop" and isinstance(gen.matched, str) and gen.matched:
        at = text.find(gen.matched)
        if at >= 0:
            return text[: at + len(gen.matched)]
    return text


def _sanitize(logprobs: Sequence[float]) -> list[float]:
    """Float noise above 0 becomes 0; a non-finite value becomes a large negative one."""
    return [min(lp, 0.0) if math.isfinite(lp) else LOGPROB_FLOOR for lp in logprobs]
