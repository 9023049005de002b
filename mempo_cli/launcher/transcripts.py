"""Reading what the agent wrote: decoded episodes and a count of how they went wrong.

``mempo eval --transcripts K`` writes the first K episodes of every mode and number of
questions as a Markdown file (``transcripts-<mode>-k<k>.md``: each round's response as
the agent wrote it and the search result it was shown) and as JSON lines
(``transcripts-<mode>-k<k>.jsonl``: each round's memory, thought, query, information,
answer, P_mem and P_full, and the episode's failure kind); every eval counts the failure
kinds of all its episodes (``eval.json``'s ``failures``). An episode gets the first kind
of this list that fits it:

- ``correct``: every sub-answer right;
- ``loop``: no answer, and one query searched three times or more (the agent keeps asking
  for what it already has, typically after writing the wrong value into its memory);
- ``no_answer``: no answer otherwise (the round limit, or a response out of format);
- ``one_answer``: fewer sub-answers than questions (a question dropped);
- ``unsearched``: a question's subject was never searched for (the agent lost track of
  a question: it searched a name it made up, or another question's);
- ``subject_in_memory``: a memory records a question's subject (or a hop's) as a value
  found (``Q1 = Drobo`` after reading "Drobo was born in ... Melthi"; an open entry
  may start with its subject, ``Q2: Roqua > ?``, as ``mempo sft --memory-subjects`` writes);
- ``wrong_relation``: a memory records another fact of the entity a hop asks about (the
  city where the employer was asked), or stops a 2-hop question after its first hop;
- ``wrong_value``: any other wrong answer.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mempo.agent_format import parse_response
from mempo.rewards import split_answers
from mempo.samples import trajectory_row
from mempo.schemas import Group, Trajectory
from mempo_sim.world import Question, World

KINDS = ("correct", "loop", "no_answer", "one_answer", "unsearched", "subject_in_memory", "wrong_relation",
         "wrong_value")  # fmt: skip
_ENTRY = re.compile(r"\s*Q(\d+)\s*([:=])\s*(.*)$")


def memory_values(memory: str, k: int) -> list[tuple[list[str], str | None]]:
    """Per question of a memory ``Q1 = b; Q2: a > ?``: (values found on the way, final
    value or None) -> [([], "b"), (["a"], None)]. Unreadable parts count as nothing."""
    out: list[tuple[list[str], str | None]] = [([], None) for _ in range(k)]
    for part in memory.split(";"):
        match = _ENTRY.match(part.strip())
        if not match or not 1 <= int(match.group(1)) <= k:
            continue
        body = match.group(3).strip()
        if match.group(2) == "=":
            out[int(match.group(1)) - 1] = ([], body or None)
        else:
            out[int(match.group(1)) - 1] = (
                [v.strip() for v in body.split(">") if v.strip() not in ("", "?")],
                None,
            )
    return out


def _chain(world: World, spec: Question) -> list[tuple[str, str, str]]:
    """(entity asked about, relation, gold value) of each hop."""
    hops, entity = [], spec.subject
    for relation in spec.relations:
        value = world.facts[entity][relation]
        hops.append((entity, relation, value))
        entity = value
    return hops


def _value_kind(world: World, spec: Question, position: int | None, value: str) -> str | None:
    """``subject_in_memory`` / ``wrong_relation`` for a value a memory holds for ``spec``
    (``position``: the hop it stands for; None: the final answer), or None if it is not
    one of those mistakes."""
    chain = _chain(world, spec)
    hops = chain if position is None else chain[position : position + 1]
    norm = value.strip().lower()
    if not hops or norm == hops[-1][2].lower():
        return None
    if norm == hops[0][0].lower():  # the entity asked about, not what was asked of it
        return "subject_in_memory"
    for entity, _, _ in hops:  # another fact of an entity on the way (or a later hop's entity)
        if norm == entity.lower() or norm in (v.lower() for v in world.facts[entity].values()):
            return "wrong_relation"
    return None


def failure_kind(
    world: World, questions: Sequence[str], traj: Trajectory, memories: Sequence[str]
) -> str:
    """The episode's kind (module docstring); ``memories``: the memory of each round."""
    if traj.correct:
        return "correct"
    queries = [r.query.lower() for r in traj.rounds if r.query]
    if traj.answer_text is None:
        return "loop" if queries and max(Counter(queries).values()) >= 3 else "no_answer"
    k = len(questions)
    if k > 1 and sum(bool(p) for p in split_answers(traj.answer_text, k)) < k:
        return "one_answer"
    specs = [world.question(q) for q in questions]
    if any(spec and not any(spec.subject.lower() in q for q in queries) for spec in specs):
        return "unsearched"
    found: set[str] = set()
    for memory in memories:
        for spec, (values, final) in zip(specs, memory_values(memory, k), strict=True):
            if spec is None:
                continue
            if values and values[0].lower() == spec.subject.lower():  # `Q2: Roqua > ?` (--memory-subjects)
                values = values[1:]
            kinds = [_value_kind(world, spec, j, v) for j, v in enumerate(values[: spec.hops])]
            kinds.append(_value_kind(world, spec, None, final) if final else None)
            found.update(kind for kind in kinds if kind)
    for kind in ("subject_in_memory", "wrong_relation"):
        if kind in found:
            return kind
    return "wrong_value"


def decoded(tok: Any, traj: Trajectory) -> list[str]:
    """Each round's response as text."""
    return [tok.decode(r.response_ids.tolist(), skip_special_tokens=True) for r in traj.rounds]


def memories(responses: Sequence[str]) -> list[str]:
    return [
        m
        for m in (parse_response(t, require_memory=False).memory for t in responses)
        if m is not None
    ]


def count_failures(world: World, tok: Any, groups: Sequence[Group]) -> dict[str, int]:
    """{kind: episodes} over every kind (zeros included)."""
    counts = dict.fromkeys(KINDS, 0)
    for group in groups:
        traj = group.trajectories[0]
        counts[failure_kind(world, group.task.questions, traj, memories(decoded(tok, traj)))] += 1
    return counts


def write_transcripts(
    stem: Path, world: World, tok: Any, groups: Sequence[Group], title: str
) -> list[Path]:
    """The episodes of ``groups``, each with its failure kind: readable (``<stem>.md``) and
    one JSON line each, round by round (``<stem>.jsonl``, mempo.samples' rows)."""
    lines, rows = [f"# {title}", ""], []
    for number, group in enumerate(groups, start=1):
        traj = group.trajectories[0]
        responses = decoded(tok, traj)
        kind = failure_kind(world, group.task.questions, traj, memories(responses))
        gold = [a[0] for a in group.task.answers]
        rows.append({"episode": number, "kind": kind, **trajectory_row(tok, group.task.questions, gold, traj)})
        lines += [f"## episode {number}: {kind}", "", f"- questions: {' | '.join(group.task.questions)}",
                  f"- gold: {' | '.join(gold)}", f"- answer: {traj.answer_text!r} (reward {traj.reward:.2f}, format ok "
                  f"{traj.format_ok}, {traj.num_tokens} tokens)", ""]  # fmt: skip
        for rnd, text in zip(traj.rounds, responses, strict=True):
            lines += [f"round {rnd.index + 1} ({len(rnd.prompt_ids)} prompt tokens):", "```", text.strip(), "```"]
            if rnd.query is not None:
                lines += ["search result:", "```", (rnd.information or "").strip() or "(nothing found)", "```"]
        lines.append("")
    markdown, jsonl = stem.with_suffix(".md"), stem.with_suffix(".jsonl")
    markdown.write_text("\n".join(lines), encoding="utf-8")
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return [markdown, jsonl]
