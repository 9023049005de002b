"""Token efficiency: memory mode (MemPO) vs full history (ReAct / Search-R1), oracle policy.

The world's oracle plays the test split's k-question tasks through the rollout worker's
own episode loop (services/rollout: the same prompt rendering, the same id appending in
full mode) against a scripted engine and BM25 search, so the counts are what an engine
would process. Tokens = every prompt and response token of every round; peak = the
longest single prompt + response. The baseline (full mode) is measured in the same run.
Prints one JSON line per k:
{"questions", "memory_tokens", "full_tokens", "ratio", "memory_peak", "full_peak", ...}.
Goal at k = 10: ratio <= 0.30 (the paper reports 0.32).

The ratio depends on how long search results are (the fixed prompt, instructions + k
questions, weighs more the shorter they are): the world's passages are about 83 words
(``WorldConfig.background`` sentences per passage), wiki-18's are 100.

    python benchmarks/token_efficiency.py [--tasks 20] [--ks 1,2,4,6,8,10]
    python benchmarks/token_efficiency.py --smoke   # seconds-scale sizes: checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mempo.bm25 import LocalSearch
from mempo.schemas import Group, Mode, Task
from mempo_sim.oracle import Oracle
from mempo_sim.tiny import default_cache_dir, ensure_tiny
from mempo_sim.world import World, WorldConfig
from services.rollout.scripted import ScriptedUpstreams
from services.rollout.settings import WorkerSettings
from services.rollout.worker import RolloutWorker


def tokens_and_peak(groups: list[Group]) -> tuple[int, int, float]:
    trajectories = [t for g in groups for t in g.trajectories]
    total = sum(t.num_tokens for t in trajectories)
    peak = max(len(r.prompt_ids) + len(r.response_ids) for t in trajectories for r in t.rounds)
    em = sum(t.correct for t in trajectories) / len(trajectories)
    return total, peak, em


async def play(
    tokenizer: Any, world: World, search: LocalSearch, mode: Mode, tasks: list[Task]
) -> list[Group]:
    oracle = Oracle(world)
    stand_ins = ScriptedUpstreams(tokenizer, lambda p: oracle.respond_to_prompt(p, mode), search)
    clients = stand_ins.upstreams(with_scorer=False)
    settings = WorkerSettings(
        redis_url="", scorer_url="", max_new_tokens=512, max_concurrent_episodes=len(tasks)
    )
    worker = RolloutWorker(settings, clients, None, tokenizer=tokenizer)
    await worker.boot()
    try:
        return list(await asyncio.gather(*(worker.run_task(t, score=False) for t in tasks)))
    finally:
        await clients.aclose()


async def main(count: int, ks: list[int]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny(default_cache_dir()))
    world = World.generate(WorldConfig(seed=0))
    search = LocalSearch(world.passages)
    for k in ks:
        pairs = world.tasks("test", k, count, seed=k)
        figures: dict[str, Any] = {"questions": k}
        for mode in ("memory", "full"):
            tasks = [Task(questions=q, answers=a, n=1, mode=mode, max_rounds=8 * k + 4) for q, a in pairs]
            total, peak, em = tokens_and_peak(await play(tokenizer, world, search, mode, tasks))
            figures.update({f"{mode}_tokens": total, f"{mode}_peak": peak, f"{mode}_em": em})
        figures["ratio"] = round(figures["memory_tokens"] / figures["full_tokens"], 4)
        figures["tasks"] = count
        order = ["questions", "memory_tokens", "full_tokens", "ratio", "memory_peak", "full_peak"]
        extra = ["memory_em", "full_em", "tasks"]
        print(json.dumps({key: figures[key] for key in [*order, *extra]}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=20, help="tasks per k")
    parser.add_argument("--ks", default="1,2,4,6,8,10", help="questions per task")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: checks it runs, proves nothing")
    args = parser.parse_args()
    if args.smoke:  # 2 tasks at k = 1 and k = 2
        args.tasks, args.ks = 2, "1,2"
    asyncio.run(main(args.tasks, [int(k) for k in args.ks.split(",")]))
