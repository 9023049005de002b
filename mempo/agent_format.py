"""The agent's text format: prompts, scoring contexts and response parsing.

The format itself: docs/rollout.md, 'The agent format'.

One definition shared by the rollout workers (prompts), the scorer (P_mem / P_full
contexts), the learner's SFT (rendered rounds) and the oracle. Everything that becomes
token ids is built by concatenating separately tokenised pieces, so a prefix shared in
text is a prefix shared in ids (the scorer's prefix sharing and full mode's appending
rely on it).

A round's response:  <mem> m </mem> <think> t </think> <search> q </search>
                or:  <mem> m </mem> <think> t </think> <answer> a1; a2 </answer>
                or:  ... <tool_call>{"name": "search", "arguments": {"query": q}}</tool_call>
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Action = Literal["search", "answer", "invalid"]
ANSWER_SEPARATOR = "; "


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer this module uses."""

    chat_template: Any

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Tags:
    """Tag names of the format; every one is configurable."""

    mem: str = "mem"
    think: str = "think"
    search: str = "search"
    answer: str = "answer"
    information: str = "information"
    tool_call: str = "tool_call"

    def open(self, name: str) -> str:
        return f"<{name}>"

    def close(self, name: str) -> str:
        return f"</{name}>"

    def all_tags(self) -> list[str]:
        names = [self.mem, self.think, self.search, self.answer, self.information, self.tool_call]
        return [t for n in names for t in (self.open(n), self.close(n))]

    def stop_strings(self) -> list[str]:
        """Generation stops after an action closes."""
        return [self.close(self.search), self.close(self.answer), self.close(self.tool_call)]


DEFAULT_TAGS = Tags()

INSTRUCTIONS = (
    "Answer by searching. Each round, write <mem>...</mem> with all you still need (only it "
    "and the latest result are kept), think in <think>...</think>, then <search> query</search> "
    "or <answer> a1; a2</answer> with one answer per question."
)


def join_questions(questions: Sequence[str]) -> str:
    return ANSWER_SEPARATOR.join(q.strip() for q in questions)


# --------------------------------------------------------------------------- prompts


def _messages(questions: Sequence[str], extra: str = "") -> list[dict[str, str]]:
    user = f"Question: {join_questions(questions)}"
    return [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": user + extra}]


def _chat_ids(tok: Tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Messages -> ids through the tokenizer's chat template, or a plain layout without one."""
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = (
            "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
            + "Assistant: "
        )
    return list(tok.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class PreviousRound:
    """What memory mode carries into the next round: nothing older than this."""

    memory: str
    query: str | None
    information: str | None


def memory_context(prev: PreviousRound, tags: Tags = DEFAULT_TAGS) -> str:
    parts = [f"\n{tags.open(tags.mem)}{prev.memory}{tags.close(tags.mem)}"]
    if prev.query is not None:
        parts.append(f"\n{tags.open(tags.search)} {prev.query}{tags.close(tags.search)}")
    if prev.information is not None:
        parts.append(f"\n{information_block(prev.information, tags).strip()}")
    return "".join(parts)


def memory_prompt_ids(
    tok: Tokenizer, questions: Sequence[str], prev: PreviousRound | None, tags: Tags = DEFAULT_TAGS
) -> list[int]:
    """Round t's prompt in memory mode: instructions + task + the previous round only."""
    extra = "" if prev is None else memory_context(prev, tags)
    return _chat_ids(tok, _messages(questions, extra))


def first_prompt_ids(tok: Tokenizer, questions: Sequence[str]) -> list[int]:
    """Round 1's prompt (the same in both modes) and the scoring contexts' prefix."""
    return _chat_ids(tok, _messages(questions))


def information_block(information: str, tags: Tags = DEFAULT_TAGS) -> str:
    """The environment's answer to a search, as Search-R1 appends it."""
    return (
        f"\n\n{tags.open(tags.information)}{information.strip()}{tags.close(tags.information)}\n\n"
    )


def information_ids(tok: Tokenizer, information: str, tags: Tags = DEFAULT_TAGS) -> list[int]:
    return list(tok.encode(information_block(information, tags), add_special_tokens=False))


def full_next_prompt_ids(
    prev_prompt_ids: Sequence[int], prev_response_ids: Sequence[int], info_ids: Sequence[int]
) -> list[int]:
    """Full mode: the next prompt appends ids (never re-tokenises the history)."""
    return [*prev_prompt_ids, *prev_response_ids, *info_ids]


def format_documents(documents: Sequence[dict[str, Any]]) -> str:
    """Search-R1's ``_passages2string``: ``Doc i(Title: "T") body`` one per line.

    Each item is a document ``{"id", "contents"}`` or a scored ``{"document", "score"}``.
    """
    lines = []
    for i, item in enumerate(documents):
        doc = item.get("document", item)
        contents = str(doc.get("contents", ""))
        title, _, text = contents.partition("\n")
        lines.append(f"Doc {i + 1}(Title: {title}) {text}\n")
    return "".join(lines).strip()


# --------------------------------------------------------------------------- scoring contexts


ANSWER_THINK = "All questions are answered."  # the thought before an answer (the oracle's too)


def answer_cue(tags: Tags = DEFAULT_TAGS) -> str:
    """What the scoring contexts end with: the agent's own way into an answer, a thought
    that it has what it needs, then ``<answer>``. The agent always thinks before it acts;
    with ``<answer>`` right after ``</mem>`` (the cue until 2026-12-06) the SFT policy gave
    the gold answer P ~ 0.000 even when its memory held it, and 0.89 with this cue
    (docs/results.md): P_mem measured the cue's strangeness, not the memory."""
    return f"{tags.open(tags.think)}{ANSWER_THINK}{tags.close(tags.think)}\n{tags.open(tags.answer)}"


def memory_piece(memory: str, tags: Tags = DEFAULT_TAGS) -> str:
    return f"{tags.open(tags.mem)}{memory}{tags.close(tags.mem)}\n"


def round_transcript(response_text: str, information: str | None, tags: Tags = DEFAULT_TAGS) -> str:
    """A round as full history holds it: the response, then the information it got."""
    return response_text + (information_block(information, tags) if information is not None else "")


def memory_scoring_ids(
    tok: Tokenizer, questions: Sequence[str], memory: str, tags: Tags = DEFAULT_TAGS
) -> list[int]:
    """Context of P_mem(t): task prompt + the memory written in round t + the answer cue."""
    return [
        *first_prompt_ids(tok, questions),
        *tok.encode(memory_piece(memory, tags), add_special_tokens=False),
        *tok.encode(answer_cue(tags), add_special_tokens=False),
    ]


def transcript_piece_ids(tok: Tokenizer, transcript: str) -> list[int]:
    return list(tok.encode(transcript, add_special_tokens=False))


def full_scoring_ids(
    tok: Tokenizer, questions: Sequence[str], transcripts: Sequence[str], tags: Tags = DEFAULT_TAGS
) -> list[int]:
    """Context of P_full(t): task prompt + transcripts of rounds 1..t-1 + the answer cue.

    Pass ``transcripts[: t - 1]``; the pieces are tokenised one by one, so the context of
    round t is a prefix-extension of round t-1's (what the scorer's prefix sharing uses).
    """
    ids = first_prompt_ids(tok, questions)
    for transcript in transcripts:
        ids.extend(transcript_piece_ids(tok, transcript))
    ids.extend(tok.encode(answer_cue(tags), add_special_tokens=False))
    return ids


def answer_target_ids(tok: Tokenizer, answer: str) -> list[int]:
    """The gold answer's tokens whose geometric-mean probability is P: the answer as the
    agent writes it after the cue, ``<answer> a1; a2``. The space belongs to the answer's
    first token (" Sabar", as everywhere mid-sentence), so the policy is scored on the
    tokens it would write, not on a rarer no-space spelling."""
    return list(tok.encode(" " + answer.strip(), add_special_tokens=False))


def answer_candidates(
    answers: Sequence[Sequence[str]], policy: Literal["best", "first"] = "best"
) -> list[str]:
    """Gold answer strings to score for a task (multi-question answers joined by "; ").

    "first": the first alias of every question. "best": candidate j takes alias
    min(j, len-1) of every question, j = 0..max aliases - 1; the scorer keeps the max P.
    (Linear in the aliases instead of their product.)
    """
    if not answers or any(len(a) == 0 for a in answers):
        raise ValueError("every question needs at least one gold alias")
    width = 1 if policy == "first" else max(len(a) for a in answers)
    candidates = [
        ANSWER_SEPARATOR.join(a[min(j, len(a) - 1)] for a in answers) for j in range(width)
    ]
    return list(dict.fromkeys(candidates))


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ParsedResponse:
    action: Action
    memory: str | None = None
    think: str | None = None
    query: str | None = None
    answer: str | None = None
    mem_chars: tuple[int, int] | None = None  # [start, end) of the memory content in the text
    error: str | None = None
    blocks: list[str] = field(default_factory=list)

    @property
    def format_ok(self) -> bool:
        return self.action != "invalid"


def _tag_pattern(tags: Tags) -> re.Pattern[str]:
    names = [tags.mem, tags.think, tags.search, tags.answer, tags.information, tags.tool_call]
    return re.compile("<(/?)(" + "|".join(re.escape(n) for n in names) + ")>")


def _tool_call_query(body: str) -> str | None:
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or call.get("name") != "search":
        return None
    args = call.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    query = args.get("query") if isinstance(args, dict) else None
    return query.strip() if isinstance(query, str) and query.strip() else None


def parse_response(
    text: str, tags: Tags = DEFAULT_TAGS, require_memory: bool = True
) -> ParsedResponse:
    """Split a response into its blocks; a response that breaks the format is "invalid".

    Rules: blocks are <mem> (required unless ``require_memory`` is false), optional
    <think>, then exactly one action (<search>, <answer> or a search <tool_call>), in
    that order, with only whitespace between and after them; no tag nests. Never raises.
    """
    try:
        return _parse(text, tags, require_memory)
    except Exception as exc:  # defensive: parsing must never take a worker down
        return ParsedResponse(action="invalid", error=f"parser error: {exc!r}")


def _parse(text: str, tags: Tags, require_memory: bool) -> ParsedResponse:
    blocks: list[tuple[str, int, int]] = []  # (name, content start, content end)
    pos, open_name, open_at = 0, None, 0
    for match in _tag_pattern(tags).finditer(text):
        closing, name = match.group(1) == "/", match.group(2)
        if open_name is None:
            if closing:
                return ParsedResponse(action="invalid", error=f"unexpected closing tag </{name}>")
            if text[pos : match.start()].strip():
                return ParsedResponse(
                    action="invalid", error=f"text outside the tags before <{name}>"
                )
            open_name, open_at = name, match.end()
        elif closing and name == open_name:
            blocks.append((name, open_at, match.start()))
            open_name, pos = None, match.end()
        else:
            return ParsedResponse(
                action="invalid", error=f"<{match.group(1)}{name}> inside <{open_name}>"
            )
    if open_name is not None:
        return ParsedResponse(action="invalid", error=f"<{open_name}> is never closed")
    if text[pos:].strip():
        return ParsedResponse(action="invalid", error="text after the last block")
    names = [b[0] for b in blocks]
    actions = (tags.search, tags.answer, tags.tool_call)
    expected_heads = [[tags.mem, tags.think], [tags.mem]]
    if not require_memory:
        expected_heads += [[tags.think], []]
    if not names or names[-1] not in actions or names[:-1] not in expected_heads:
        return ParsedResponse(
            action="invalid", error=f"blocks {names} are not mem, think, action", blocks=names
        )
    content = {name: text[s:e] for name, s, e in blocks}
    mem_chars = next(((s, e) for name, s, e in blocks if name == tags.mem), None)
    memory = content.get(tags.mem)
    think = content.get(tags.think)
    action_name, body = names[-1], content[names[-1]].strip()
    common: dict[str, Any] = {
        "memory": memory,
        "think": think,
        "mem_chars": mem_chars,
        "blocks": names,
    }
    if action_name == tags.answer:
        if not body:
            return ParsedResponse(action="invalid", error="empty answer", **common)
        return ParsedResponse(action="answer", answer=body, **common)
    query = body if action_name == tags.search else _tool_call_query(body)
    if not query:
        return ParsedResponse(action="invalid", error=f"empty or malformed {action_name}", **common)
    return ParsedResponse(action="search", query=query, **common)


def mem_token_span(
    tok: Tokenizer, response_ids: Sequence[int], text: str, mem_chars: tuple[int, int] | None
) -> tuple[int, int] | None:
    """Token span [start, end) of the memory content, given its char span in ``text``.

    ``text`` must be ``tok.decode(response_ids, skip_special_tokens=True)``. Start is the
    first token that reaches into the content, end the first token past it: a token that
    straddles a boundary (or holds part of a multi-byte character) belongs to the span.
    Prefix decodes are binary-searched, so this works for any tokenizer.
    """
    if mem_chars is None:
        return None
    ids = list(response_ids)
    cache: dict[int, str] = {}

    def prefix(n: int) -> str:
        if n not in cache:
            cache[n] = tok.decode(ids[:n], skip_special_tokens=True)
        return cache[n]

    # A prefix that ends inside a multi-byte character decodes with a trailing U+FFFD.
    # "Reached" counts that partial character (its first byte is in), "complete" does not.
    def reached(n: int) -> int:
        return len(prefix(n))

    def complete(n: int) -> int:
        return len(prefix(n).rstrip("\ufffd"))

    def first(length: Callable[[int], int], offset: int) -> int:
        """Smallest n with length(n) >= offset (prefix lengths grow with n)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if length(mid) >= offset:
                hi = mid
            else:
                lo = mid + 1
        return lo

    start_char, end_char = mem_chars
    if start_char == end_char:
        n = first(complete, start_char)
        return (n, n)
    start = first(reached, start_char + 1) - 1  # the token holding the first content byte
    end = first(complete, end_char)  # one past the token holding the last content byte
    return (max(start, 0), max(end, start))
