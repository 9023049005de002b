"""Worker overhead per round, and 1,000 concurrent episodes on one worker.

The rollout worker runs the world's oracle tasks against zero-latency stand-ins of the
engine, retrieval and scorer (services/rollout/scripted.py behind httpx.MockTransport,
so the worker's real HTTP clients, JSON encoding and response validation all run). The
time the stand-ins themselves spend (the oracle, tokenising its reply, BM25) is measured
and subtracted: what is left is the worker's own cost per round (prompt rendering,
request/response handling, decoding, parsing, the <mem> span, records, scoring request,
group assembly). Episodes run one at a time for the per-round figure; then 1,000 run at
once (125 tasks x n = 8) and every failure is counted.
Prints one JSON line: {"ms_per_round", "concurrent_episodes", "errors", ...}.
Goal: ms_per_round < 5.

    python benchmarks/agent_overhead.py [--tasks 60] [--concurrent 1000]
    python benchmarks/agent_overhead.py --smoke   # seconds-scale sizes: checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mempo.bm25 import LocalSearch
from mempo.schemas import Mode, Task
from mempo_sim.oracle import Oracle
from mempo_sim.tiny import default_cache_dir, ensure_tiny
from mempo_sim.world import World, WorldConfig
from services.rollout.scripted import ScriptedUpstreams
from services.rollout.settings import WorkerSettings
from services.rollout.worker import RolloutWorker


async def make_worker(
    tokenizer: Any, world: World, search: LocalSearch, mode: Mode, concurrency: int
) -> tuple[RolloutWorker, ScriptedUpstreams]:
    oracle = Oracle(world)
    stand_ins = ScriptedUpstreams(tokenizer, lambda p: oracle.respond_to_prompt(p, mode), search)
    settings = WorkerSettings(
        redis_url="",
        scorer_url="http://scorer",
        max_new_tokens=512,
        max_concurrent_episodes=concurrency,
    )
    worker = RolloutWorker(settings, stand_ins.upstreams(), None, tokenizer=tokenizer)
    await worker.boot()
    return worker, stand_ins


async def per_round_ms(tokenizer: Any, world: World, search: LocalSearch, mode: Mode, count: int) -> tuple[float, float, int]:
    """(worker ms per round, stand-in ms per round, rounds), one episode at a time."""
    worker, stand_ins = await make_worker(tokenizer, world, search, mode, 1)
    tasks = [
        Task(questions=q, answers=a, n=1, mode=mode, max_rounds=32)
        for q, a in world.tasks("test", 3, count, seed=7)
    ]
    await worker.run_task(tasks[0])  # warm-up (jinja template compile, first allocations)
    stand_ins.busy_s, rounds_before = 0.0, worker.metrics.rounds
    started = time.perf_counter()
    for task in tasks:
        await worker.run_task(task)
    wall = time.perf_counter() - started
    rounds = worker.metrics.rounds - rounds_before
    await worker.upstreams.aclose()
    return 1000 * (wall - stand_ins.busy_s) / rounds, 1000 * stand_ins.busy_s / rounds, rounds


async def concurrent(tokenizer: Any, world: World, search: LocalSearch, episodes: int) -> dict[str, Any]:
    worker, stand_ins = await make_worker(tokenizer, world, search, "memory", episodes)
    n = 8
    tasks = [
        Task(questions=q, answers=a, n=n, mode="memory", max_rounds=32)
        for q, a in world.tasks("test", 2, episodes // n, seed=8)
    ]
    peak = 0

    def sample() -> None:
        nonlocal peak
        peak = max(peak, worker.metrics.in_flight_episodes)

    stand_ins.on_generate = sample
    started = time.perf_counter()
    results = await asyncio.gather(*(worker.run_task(t) for t in tasks), return_exceptions=True)
    wall = time.perf_counter() - started
    await worker.upstreams.aclose()
    groups = [r for r in results if not isinstance(r, BaseException)]
    trajectories = [t for g in groups for t in g.trajectories]
    return {
        "concurrent_episodes": peak,
        "errors": len(results) - len(groups) + sum(not t.format_ok for t in trajectories),
        "concurrent_episodes_done": len(trajectories),
        "concurrent_em": round(sum(t.correct for t in trajectories) / max(1, len(trajectories)), 4),
        "concurrent_wall_s": round(wall, 2),
    }


async def main(count: int, episodes: int) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny(default_cache_dir()))
    world = World.generate(WorldConfig(seed=0))
    search = LocalSearch(world.passages)
    memory_ms, stub_ms, rounds = await per_round_ms(tokenizer, world, search, "memory", count)
    full_ms, _, _ = await per_round_ms(tokenizer, world, search, "full", count)
    figures = {
        "ms_per_round": round(memory_ms, 3),
        **await concurrent(tokenizer, world, search, episodes),
        "full_ms_per_round": round(full_ms, 3),
        "stand_in_ms_per_round": round(stub_ms, 3),
        "rounds": rounds,
        "goal_ms_per_round": 5.0,
    }
    order = ["ms_per_round", "concurrent_episodes", "errors"]
    print(json.dumps({k: figures[k] for k in [*order, *(k for k in figures if k not in order)]}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=60, help="sequential 3-question tasks")
    parser.add_argument("--concurrent", type=int, default=1000, help="episodes at once")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: checks it runs, proves nothing")
    args = parser.parse_args()
    if args.smoke:  # 2 sequential tasks per mode; 16 concurrent episodes (2 tasks x n = 8)
        args.tasks, args.concurrent = 2, 16
    asyncio.run(main(args.tasks, args.concurrent))
