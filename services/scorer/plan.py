"""Scoring plans: the token trees a request becomes, and the numbers read back from them.

A request's contexts share prefixes (every round's P_full context extends the previous
round's; every P_mem context starts with the task prompt; every alias shares its
context). A ``Row`` holds them as a tree: a ``trunk`` (the longest shared token run,
computed once, causally) and ``Segment`` branches, each seeing a prefix of the trunk
(``attach``), its ancestor segments and itself. The token sequence that scores a
segment is ``row.context_of(i) + segment.ids``, exactly the ids that
mempo/agent_format.py defines (tests check this against ``memory_scoring_ids`` /
``full_scoring_ids`` / ``answer_target_ids``).

Planning takes the token limit of a row and stops as soon as the row would pass it
(``RowTooLong``): the rest of the entry is neither tokenised nor built, so an entry far
over the limit costs no more than the part of it read so far.

Glossary: R rounds, C answer candidates, S segments of a row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from mempo import agent_format as fmt
from mempo.agent_format import Tokenizer
from mempo.api.scorer import (
    AliasPolicy,
    ChatMessage,
    ItemScore,
    MemoryTrajectory,
    RoundScore,
    ScoreItem,
    TrajectoryScores,
)


@dataclass(frozen=True)
class Segment:
    """A run of tokens that sees ``trunk[:attach]``, its ancestors and itself.

    ``parent`` indexes an earlier segment of the row (its ``attach`` must be the
    parent's); ``scored`` segments are answer targets and need a parent (the token that
    predicts their first token must exist in the branch).
    """

    ids: tuple[int, ...]
    attach: int
    parent: int | None = None
    scored: bool = False


@dataclass
class Row:
    """One tree: a trunk and its branches. Segments are listed parents first."""

    trunk: list[int]
    segments: list[Segment] = field(default_factory=list)

    def add(
        self, ids: Sequence[int], attach: int, parent: int | None = None, scored: bool = False
    ) -> int:
        if parent is not None and self.segments[parent].attach != attach:
            raise ValueError("a segment attaches where its parent does")
        if scored and parent is None:
            raise ValueError("a scored segment needs a parent segment")
        if not ids:
            raise ValueError("a segment needs at least one token")
        if not 0 <= attach <= len(self.trunk):
            raise ValueError(f"attach {attach} outside the trunk of {len(self.trunk)} tokens")
        self.segments.append(Segment(tuple(ids), attach, parent, scored))
        return len(self.segments) - 1

    @property
    def branch_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)

    @property
    def num_tokens(self) -> int:
        return len(self.trunk) + self.branch_tokens

    def ancestors(self, index: int) -> list[int]:
        """Indices of the segment's ancestors, root first (itself excluded)."""
        chain = []
        parent = self.segments[index].parent
        while parent is not None:
            chain.append(parent)
            parent = self.segments[parent].parent
        return chain[::-1]

    def context_of(self, index: int) -> list[int]:
        """The ids in front of segment ``index`` in its own plain sequence."""
        ids = list(self.trunk[: self.segments[index].attach])
        for a in self.ancestors(index):
            ids.extend(self.segments[a].ids)
        return ids

    def scored_segments(self) -> list[int]:
        return [i for i, s in enumerate(self.segments) if s.scored]


# --------------------------------------------------------------------------- building


class RowTooLong(Exception):
    """A row passed the token limit while it was planned. ``tokens``: the tokens it holds
    at that point (the whole entry holds at least that many); the rest of the entry was not
    tokenised."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"{tokens} tokens exceed the limit of {limit}")
        self.tokens = tokens
        self.limit = limit


def _guard(tokens: int, limit: int | None) -> None:
    if limit is not None and tokens > limit:
        raise RowTooLong(tokens, limit)


@dataclass(frozen=True)
class Target:
    """One (context, candidate) whose answer tokens are scored: a scored segment of a row."""

    row: int
    segment: int
    context_tokens: int


@dataclass
class MemoryPlan:
    """P_mem / P_full of one trajectory: targets per round and candidate."""

    candidates: list[str]
    full: list[list[Target]]  # (R, C)
    mem: list[list[Target] | None]  # (R, C), None for a round without memory
    task: list[Target] | None = None  # (C,) P_task: the memory context with an empty memory
    task_of: int | None = None  # the plan.memory entry that scores this trajectory's P_task


@dataclass
class ItemPlan:
    answers: list[str]
    targets: list[Target]  # one per alias


@dataclass
class Plan:
    """Rows to run and how their scored segments map back to the request."""

    rows: list[Row] = field(default_factory=list)
    memory: list[MemoryPlan] = field(default_factory=list)
    items: list[ItemPlan] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


def _add_answers(
    row_index: int, row: Row, parent: int, answers: Sequence[Sequence[int]]
) -> list[Target]:
    context = len(row.context_of(parent)) + len(row.segments[parent].ids)
    attach = row.segments[parent].attach
    return [
        Target(row_index, row.add(ids, attach, parent, scored=True), context) for ids in answers
    ]


def plan_memory(
    plan: Plan,
    tok: Tokenizer,
    trajectory: MemoryTrajectory,
    policy: AliasPolicy,
    limit: int | None = None,
    task: bool = False,
) -> None:
    """Add one trajectory's row: trunk = task prompt + transcripts of rounds 1..R-1.
    ``task``: also P_task's branch (an empty memory + cue, after the task prompt).

    Round t's P_full branch (answer cue, then each candidate) attaches after round
    t-1's transcript; its P_mem branch (memory piece + cue, then each candidate)
    attaches after the task prompt. With a ``limit``, raises ``RowTooLong`` (adding
    nothing to the plan) as soon as the row is known to pass it: before any transcript
    when the branches alone (R + memories of cue + answers) do, else at the first
    transcript or round that takes it past.
    """
    candidates = fmt.answer_candidates(trajectory.answers, policy)
    answer_ids = [fmt.answer_target_ids(tok, c) for c in candidates]
    answer_tokens = sum(len(ids) for ids in answer_ids)
    cue = tok.encode(fmt.answer_cue(), add_special_tokens=False)
    prompt = fmt.first_prompt_ids(tok, trajectory.questions)
    rounds = trajectory.rounds
    # every round's P_full branch and every memory's P_mem branch holds at least the cue
    # and the answers: a lower bound of the row, before any transcript is tokenised
    branches = len(rounds) + sum(r.memory is not None for r in rounds) + int(task)
    _guard(len(prompt) + branches * (len(cue) + answer_tokens), limit)
    trunk = list(prompt)
    boundaries = [len(trunk)]  # trunk length seen by round t's P_full branch (t = 1..R)
    for r in rounds[:-1]:
        trunk.extend(fmt.transcript_piece_ids(tok, r.transcript))
        _guard(len(trunk) + answer_tokens, limit)
        boundaries.append(len(trunk))
    row, index = Row(trunk), len(plan.rows)
    tokens = len(trunk)
    entry = MemoryPlan(candidates=candidates, full=[], mem=[])
    for t, r in enumerate(rounds):
        tokens += len(cue) + answer_tokens
        _guard(tokens, limit)
        cue_seg = row.add(cue, boundaries[t])
        entry.full.append(_add_answers(index, row, cue_seg, answer_ids))
        if r.memory is None:
            entry.mem.append(None)
            continue
        piece = tok.encode(fmt.memory_piece(r.memory), add_special_tokens=False)
        tokens += len(piece) + len(cue) + answer_tokens
        _guard(tokens, limit)
        mem_seg = row.add([*piece, *cue], len(prompt))
        entry.mem.append(_add_answers(index, row, mem_seg, answer_ids))
    if task:  # P_task: exactly a memory branch whose memory is empty
        piece = tok.encode(fmt.memory_piece(""), add_special_tokens=False)
        _guard(tokens + len(piece) + len(cue) + answer_tokens, limit)
        entry.task = _add_answers(index, row, row.add([*piece, *cue], len(prompt)), answer_ids)
    plan.rows.append(row)
    plan.memory.append(entry)


def context_ids(tok: Tokenizer, context: str | list[ChatMessage]) -> list[int]:
    """A generic item's context: plain text as is, messages as the agent's prompts render them."""
    if isinstance(context, str):
        return list(tok.encode(context, add_special_tokens=False))
    return fmt._chat_ids(tok, [m.model_dump() for m in context])


def plan_item(
    plan: Plan, tok: Tokenizer, item: ScoreItem, policy: AliasPolicy, limit: int | None = None
) -> list[int]:
    """Add one generic item's row; returns its context ids (empty: nothing was added).

    The context's last token is the branch root (it predicts every alias's first token).
    With a ``limit``, raises ``RowTooLong`` (adding nothing) when the context, or the
    context with the aliases, passes it; a context over it alone is refused before its
    aliases are tokenised.
    """
    ctx = context_ids(tok, item.context)
    if not ctx:
        return ctx
    _guard(len(ctx), limit)
    answers = item.answers[:1] if policy == "first" else list(dict.fromkeys(item.answers))
    answer_ids = []
    tokens = len(ctx)
    for a in answers:
        answer_ids.append(fmt.answer_target_ids(tok, a))
        tokens += len(answer_ids[-1])
        _guard(tokens, limit)
    row, index = Row(ctx[:-1]), len(plan.rows)
    root = row.add(ctx[-1:], len(ctx) - 1)
    targets = _add_answers(index, row, root, answer_ids)
    plan.rows.append(row)
    plan.items.append(ItemPlan(answers=answers, targets=targets))
    return ctx


# --------------------------------------------------------------------------- reading back

LogProbTable = dict[tuple[int, int], list[float]]  # (row, segment) -> per-token log-probs


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else float("-inf")


def _best(targets: Sequence[Target], logprobs: LogProbTable) -> tuple[float, Target]:
    """Max P over candidates (the first wins ties); P = exp(mean log-prob)."""
    means = [_mean(logprobs[(t.row, t.segment)]) for t in targets]
    j = max(range(len(means)), key=lambda i: means[i])
    return math.exp(means[j]), targets[j]


def memory_results(plan: Plan, logprobs: LogProbTable) -> list[TrajectoryScores]:
    results = []
    for entry in plan.memory:
        rounds = []
        for t, (full, mem) in enumerate(zip(entry.full, entry.mem, strict=True)):
            p_full, full_target = _best(full, logprobs)
            p_mem, mem_target = _best(mem, logprobs) if mem is not None else (None, None)
            rounds.append(
                RoundScore(
                    index=t,
                    p_mem=p_mem,
                    p_full=p_full,
                    reward=None if p_mem is None else p_mem - p_full,
                    mem_context_tokens=None if mem_target is None else mem_target.context_tokens,
                    full_context_tokens=full_target.context_tokens,
                )
            )
        results.append(TrajectoryScores(rounds=rounds, candidates=entry.candidates))
    for entry, result in zip(plan.memory, results, strict=True):
        if entry.task_of is not None:  # scored once per distinct task of the request
            result.p_task = _best(plan.memory[entry.task_of].task or [], logprobs)[0]
    return results


def item_results(plan: Plan, logprobs: LogProbTable) -> list[ItemScore]:
    scores = []
    for entry in plan.items:
        _, target = _best(entry.targets, logprobs)
        values = logprobs[(target.row, target.segment)]
        mean = _mean(values)
        scores.append(
            ItemScore(
                answer=entry.answers[entry.targets.index(target)],
                logprob_sum=math.fsum(values),
                logprob_mean=mean,
                num_tokens=len(values),
                p=math.exp(mean),
                context_tokens=target.context_tokens,
            )
        )
    return scores
