"""What the agent wrote, decoded: one row per trajectory, round by round (its memory,
thought, query, the information it was shown, its answer, P_mem and P_full), for the
trackers' sample tables (mempo.tracking) and ``mempo eval --transcripts``."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mempo.agent_format import parse_response
from mempo.schemas import Group, Trajectory

# A sample table's columns: one line per round.
COLUMNS = ("trajectory", "round", "memory", "think", "query", "information", "answer", "reward", "p_mem", "p_full")


def trajectory_row(tok: Any, questions: Sequence[str], gold: Sequence[str], traj: Trajectory) -> dict[str, Any]:
    """One trajectory decoded: the task, its outcome and each round's blocks."""
    rounds, scored = [], iter(zip(traj.p_mem, traj.p_full, strict=True))
    for rnd in traj.rounds:
        text = tok.decode(rnd.response_ids.tolist(), skip_special_tokens=True)
        parsed = parse_response(text, require_memory=False)
        p_mem, p_full = next(scored, (None, None)) if rnd.mem_span is not None else (None, None)
        rounds.append({
            "round": rnd.index + 1, "memory": parsed.memory, "think": parsed.think, "query": parsed.query,
            "information": rnd.information, "answer": parsed.answer, "p_mem": p_mem, "p_full": p_full,
            "text": None if parsed.format_ok else text,  # a response out of format, as written
        })  # fmt: skip
    return {
        "questions": list(questions), "gold": list(gold), "answer": traj.answer_text,
        "reward": traj.reward, "correct": traj.correct, "format_ok": traj.format_ok,
        "tokens": traj.num_tokens, "rounds": rounds,
    }  # fmt: skip


def sample_rows(tok: Any, groups: Sequence[Group], count: int) -> list[dict[str, Any]]:
    """``count`` trajectories of ``groups`` decoded: the first of each group in turn, then
    the second, ..., so the samples span tasks."""
    picked: list[dict[str, Any]] = []
    for index in range(max((len(g.trajectories) for g in groups), default=0)):
        for group in groups:
            if len(picked) >= count:
                return picked
            if index < len(group.trajectories):
                gold = [aliases[0] for aliases in group.task.answers]
                picked.append(trajectory_row(tok, group.task.questions, gold, group.trajectories[index]))
    return picked


def table_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    """``rows`` as a table of COLUMNS, one line per round."""
    return [
        [number, *(row["reward"] if column == "reward" else rnd[column] for column in COLUMNS[1:])]
        for number, row in enumerate(rows, start=1)
        for rnd in row["rounds"]
    ]


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """``rows`` readable: each trajectory's task and outcome, then its rounds."""
    lines: list[str] = []
    for number, row in enumerate(rows, start=1):
        lines += [f"### trajectory {number}: reward {row['reward']:.2f}", "",
                  f"- questions: {' | '.join(row['questions'])}", f"- gold: {' | '.join(row['gold'])}",
                  f"- answer: {row['answer']!r} ({row['tokens']} tokens)", ""]  # fmt: skip
        for rnd in row["rounds"]:
            scored = f", P_mem {rnd['p_mem']:.3f} P_full {rnd['p_full']:.3f}" if rnd["p_mem"] is not None else ""
            lines.append(f"round {rnd['round']}{scored}:")
            for key in ("memory", "think", "query", "answer", "text"):
                if rnd[key] is not None:
                    lines.append(f"    {key}: {json.dumps(rnd[key])[1:-1]}")
            if rnd["query"] is not None:
                lines.append(f"    information: {json.dumps(rnd['information'] or '(nothing found)')[1:-1]}")
        lines.append("")
    return "\n".join(lines)
