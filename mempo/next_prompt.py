"""The prompt of the agent's next round, given the round it just played.

One definition for the rollout worker's episode loop (services/rollout/episode.py) and
the learner's SFT data (services/learner/sft.py), so SFT trains on exactly the prompts
that rollouts show.
"""

from __future__ import annotations

from collections.abc import Sequence

from mempo.agent_format import (
    DEFAULT_TAGS,
    ParsedResponse,
    PreviousRound,
    Tags,
    Tokenizer,
    full_next_prompt_ids,
    information_ids,
    memory_prompt_ids,
)
from mempo.schemas import Round


def next_prompt_ids(
    tok: Tokenizer,
    questions: Sequence[str],
    played: Round,
    parsed: ParsedResponse,
    memory_mode: bool,
    tags: Tags = DEFAULT_TAGS,
) -> list[int]:
    """The prompt after ``played``, a round that searched; ``parsed`` is its response parsed.

    Memory mode: the task and this round only (its memory, its query and the information
    it got), tokenised afresh. Full mode: this round's prompt, response and information
    ids appended, so the history is never re-tokenised.
    """
    information = played.information or ""
    if memory_mode:
        prev = PreviousRound(
            memory=parsed.memory or "", query=parsed.query, information=information
        )
        return memory_prompt_ids(tok, questions, prev, tags)
    info = information_ids(tok, information, tags)
    return full_next_prompt_ids(played.prompt_ids.tolist(), played.response_ids.tolist(), info)
