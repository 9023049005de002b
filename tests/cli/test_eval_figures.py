"""``mempo eval``'s full-history replay (mempo_cli/launcher/evaluate.py): what a memory-mode
episode would have cost with the whole history in context equals, token for token, the
full-mode episode of the same responses (the oracle writes the same responses in both
modes)."""

from __future__ import annotations

from typing import Any

from mempo.agent_format import format_documents
from mempo.bm25 import LocalSearch
from mempo.schemas import Group, Task, Trajectory
from mempo_cli.launcher.evaluate import full_history_figures
from mempo_sim.oracle import Oracle
from mempo_sim.world import World
from services.learner.sft import oracle_rounds


def _groups(world: World, tok: Any, mode: str, k: int) -> list[Group]:
    index, oracle = LocalSearch(world.passages), Oracle(world)
    groups = []
    for questions, answers in world.tasks("test", k, 4, seed=3):
        rounds = oracle_rounds(
            tok, questions, lambda q: format_documents(index.retrieve([q], 3)[0]), oracle, mode
        )
        task = Task(questions=questions, answers=answers, n=1, mode=mode)  # type: ignore[arg-type]
        groups.append(
            Group(
                group_id=task.group_id,
                task=task,
                trajectories=[Trajectory(rounds=rounds)],
                policy_version=0,
            )
        )
    return groups


def test_the_replay_of_memory_episodes_is_the_full_mode_episode(
    world: World, tokenizer: Any
) -> None:
    for k in (1, 2):
        memory, full = _groups(world, tokenizer, "memory", k), _groups(world, tokenizer, "full", k)
        for m, f in zip(memory, full, strict=True):
            assert [r.response_ids.tolist() for r in m.trajectories[0].rounds] == [
                r.response_ids.tolist() for r in f.trajectories[0].rounds
            ]
        sizes = [
            [len(r.prompt_ids) + len(r.response_ids) for r in g.trajectories[0].rounds]
            for g in full
        ]
        replay = full_history_figures(tokenizer, memory)
        assert replay["full_history_tokens_per_task"] == sum(map(sum, sizes)) / len(sizes)
        assert replay["full_history_peak_tokens"] == max(map(max, sizes))
        own = [
            max(len(r.prompt_ids) + len(r.response_ids) for r in g.trajectories[0].rounds)
            for g in memory
        ]
        if k == 2:  # several rounds: the memory keeps the context below the full history
            assert max(own) < replay["full_history_peak_tokens"]
