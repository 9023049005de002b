"""The world's oracle policy: the ideal rounds, given what retrieval actually returns.

It knows each question's chain of relations (not the answers): it searches one hop at a
time, reads the value out of the retrieved text, and keeps everything it has found in
its memory, ``Q1 = Dostania; Q2: Velmar Guild > ?; Q3: ?``. In memory mode that memory is its whole
state (it sees nothing older than the previous round); in full mode it replays the
history. A failed read is retried once with a second query, then recorded as
"unknown". Its texts feed SFT, the scripted engine of the rollout tests and the
benchmarks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mempo.agent_format import ANSWER_SEPARATOR, ANSWER_THINK, DEFAULT_TAGS, Tags, join_questions
from mempo_sim.world import RELATIONS, Question, World

UNKNOWN = "unknown"
_SEARCH_ATTEMPTS = 2


@dataclass(frozen=True)
class OracleRound:
    response: str
    query: str | None  # None in the answer round
    information: str | None  # what the search returned (None in the answer round)


class Oracle:
    def __init__(self, world: World, tags: Tags = DEFAULT_TAGS, subjects: bool = False) -> None:
        """``subjects``: an open question's memory starts with its subject
        (``Q2: Roqua > ?``), so the policy copies the name it must search from its memory
        instead of finding it again in the question line."""
        self.world = world
        self.tags = tags
        self.subjects = subjects

    # ----------------------------------------------------------------- state

    def _specs(self, questions: Sequence[str]) -> list[Question]:
        specs = []
        for text in questions:
            spec = self.world.question(text)
            if spec is None:
                raise ValueError(f"the oracle does not know the question {text!r}")
            specs.append(spec)
        return specs

    @staticmethod
    def parse_memory(memory: str, hops: Sequence[int], subjects: bool = False) -> list[list[str]]:
        """``Q1 = b; Q2: a > ?; Q3: ?`` -> [[b, b], [a], []] for 2-hop questions.

        A finished question keeps only its answer (``=``, the memory stays short); an open
        one keeps the values found so far (after its subject, with ``subjects``). Anything
        unreadable counts as nothing found.
        """
        state: list[list[str]] = [[] for _ in hops]
        for part in memory.split(";"):
            match = re.match(r"\s*Q(\d+)\s*([:=])\s*(.*)$", part.strip())
            if not match or not 1 <= int(match.group(1)) <= len(hops):
                continue
            i, done, body = int(match.group(1)) - 1, match.group(2) == "=", match.group(3).strip()
            if done and body:
                state[i] = [body] * hops[i]
            elif not done:
                values = [v for v in (v.strip() for v in body.split(">")) if v and v != "?"]
                state[i] = values[1 if subjects else 0 :][: max(hops[i] - 1, 0)]
        return state

    @staticmethod
    def format_memory(state: list[list[str]], specs: list[Question], subjects: bool = False) -> str:
        parts = []
        for i, (values, spec) in enumerate(zip(state, specs, strict=True)):
            if len(values) >= spec.hops:
                parts.append(f"Q{i + 1} = {values[-1]}")
            else:
                head = [spec.subject] if subjects else []
                parts.append(f"Q{i + 1}: " + " > ".join([*head, *values, "?"]))
        return ANSWER_SEPARATOR.join(parts)

    def _pending(self, state: list[list[str]], specs: list[Question]) -> int | None:
        return next(
            (i for i, (v, s) in enumerate(zip(state, specs, strict=True)) if len(v) < s.hops), None
        )

    def _queries(
        self, state: list[list[str]], specs: list[Question], i: int
    ) -> tuple[str, str, list[str]]:
        subject = state[i][-1] if state[i] else specs[i].subject
        relation = specs[i].relations[len(state[i])]
        return subject, relation, [subject, f"{subject} {RELATIONS[relation].keyword}"]

    def update(
        self, state: list[list[str]], specs: list[Question], query: str, information: str
    ) -> None:
        """Fold one (query, information) pair into the state."""
        i = self._pending(state, specs)
        if i is None:
            return
        subject, relation, variants = self._queries(state, specs, i)
        value = self.world.extract(relation, subject, information)
        if value is not None:
            state[i].append(value)
        elif query == variants[-1]:  # the last attempt failed too: give up on this question
            state[i].extend([UNKNOWN] * (specs[i].hops - len(state[i])))

    # ----------------------------------------------------------------- responses

    def next_response(
        self,
        questions: Sequence[str],
        state: list[list[str]],
        last_query: str | None,
    ) -> tuple[str, str | None]:
        """(response text, query or None for the answer round)."""
        t = self.tags
        specs = self._specs(questions)
        head = f"{t.open(t.mem)}{self.format_memory(state, specs, self.subjects)}{t.close(t.mem)}\n"
        i = self._pending(state, specs)
        if i is None:
            answer = ANSWER_SEPARATOR.join(v[-1] for v in state)
            think = ANSWER_THINK
            return (
                f"{head}{t.open(t.think)}{think}{t.close(t.think)}\n{t.open(t.answer)} {answer}{t.close(t.answer)}",
                None,
            )
        subject, relation, variants = self._queries(state, specs, i)
        attempt = variants.index(last_query) + 1 if last_query in variants[:-1] else 0
        query = variants[min(attempt, _SEARCH_ATTEMPTS - 1)]
        think = f"Q{i + 1} needs the {RELATIONS[relation].phrase} of {subject}."
        return (
            f"{head}{t.open(t.think)}{think}{t.close(t.think)}\n{t.open(t.search)} {query}{t.close(t.search)}",
            query,
        )

    def respond_memory(
        self,
        questions: Sequence[str],
        memory: str | None,
        query: str | None,
        information: str | None,
    ) -> str:
        """Memory mode: the state is the previous memory plus the latest result."""
        specs = self._specs(questions)
        state = self.parse_memory(memory or "", [q.hops for q in specs], self.subjects)
        if query is not None and information is not None:
            self.update(state, specs, query, information)
        return self.next_response(questions, state, query)[0]

    def respond_full(self, questions: Sequence[str], history: Sequence[tuple[str, str]]) -> str:
        """Full mode: replay every (query, information) pair of the history. The response
        has the same format as in memory mode, <mem> included (docs/rollout.md, 'The agent
        format': the instructions and round 1's prompt are the same in both modes; only the
        context differs)."""
        specs = self._specs(questions)
        state: list[list[str]] = [[] for _ in specs]
        for query, information in history:
            self.update(state, specs, query, information)
        last = history[-1][0] if history else None
        return self.next_response(questions, state, last)[0]

    def respond_to_prompt(self, prompt_text: str, mode: str) -> str:
        """Answer a rendered prompt (the scripted engine of tests and benchmarks).

        Reads only what the prompt shows after its last ``Question:`` line, so in memory
        mode it can use nothing older than the previous round.
        """
        t = self.tags
        tail = prompt_text[prompt_text.rfind("Question: ") + len("Question: ") :]
        question_line = tail.split("\n", 1)[0]
        questions = self._split_question_line(question_line)
        body = tail[len(question_line) :]

        def blocks(name: str) -> list[str]:
            pattern = re.escape(t.open(name)) + r"(.*?)" + re.escape(t.close(name))
            return [block.strip() for block in re.findall(pattern, body, re.S)]

        queries, infos = blocks(t.search), blocks(t.information)
        if mode == "memory":
            mems = blocks(t.mem)
            return self.respond_memory(
                questions,
                mems[-1] if mems else None,
                queries[-1] if queries else None,
                infos[-1] if infos else None,
            )
        return self.respond_full(questions, list(zip(queries, infos, strict=False)))

    def _split_question_line(self, line: str) -> list[str]:
        """Split a joined question line back into the world's questions."""
        parts = [p.strip() for p in line.strip().split(ANSWER_SEPARATOR.strip())]
        questions = [p for p in parts if p]
        if join_questions(questions) != line.strip():
            raise ValueError(f"cannot split question line {line!r}")
        return questions

    # ----------------------------------------------------------------- episodes

    def episode(
        self,
        questions: Sequence[str],
        search: Callable[[str], str],
        mode: str = "memory",
        max_rounds: int = 32,
    ) -> list[OracleRound]:
        """Play a whole task; ``search(query)`` returns the formatted information text."""
        rounds: list[OracleRound] = []
        memory: str | None = None
        history: list[tuple[str, str]] = []
        for _ in range(max_rounds):
            if mode == "memory":
                last = rounds[-1] if rounds else None
                response = self.respond_memory(
                    questions,
                    memory,
                    last.query if last else None,
                    last.information if last else None,
                )
                memory = response.split(self.tags.close(self.tags.mem))[0].removeprefix(
                    self.tags.open(self.tags.mem)
                )
            else:
                response = self.respond_full(questions, history)
            query = _action_body(response, self.tags.search, self.tags)
            if query is None:
                rounds.append(OracleRound(response, None, None))
                return rounds
            information = search(query)
            history.append((query, information))
            rounds.append(OracleRound(response, query, information))
        return rounds


def _action_body(response: str, name: str, tags: Tags) -> str | None:
    match = re.search(
        re.escape(tags.open(name)) + r"(.*?)" + re.escape(tags.close(name)), response, re.S
    )
    return match.group(1).strip() if match else None
