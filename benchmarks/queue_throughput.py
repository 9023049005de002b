"""Queue throughput: one Group (16 trajectories x 8 rounds x 512 tokens) through the streams.

Each repetition encodes the group (JSON + binary array sidecar), XADDs it, reads it back through the
learner's consumer group, decodes and acks it. The baseline, measured in the same run on
the same redis-server, is a raw SET + GET of the same number of bytes. Prints one JSON
line: {"payload_mb_s", "raw_mb_s", "ratio", ...}. Goal: ratio >= 0.3.

    python benchmarks/queue_throughput.py [--reps 20] [--encoding sidecar|b64|plain]
    python benchmarks/queue_throughput.py --smoke   # seconds-scale sizes: checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from mempo.arrays import dump_with_sidecar
from mempo.keys import Keys
from mempo.procs import RedisServer
from mempo.queue import RedisQueue, connect
from mempo.schemas import Group, Round, Task, Trajectory


def make_group(trajectories: int = 16, rounds: int = 8, tokens: int = 512, seed: int = 0) -> Group:
    rng = random.Random(seed)
    task = Task(questions=["q"], answers=[["a"]], n=trajectories)

    def one_round(i: int) -> Round:
        return Round(
            index=i,
            prompt_ids=[rng.randrange(150_000) for _ in range(tokens)],
            response_ids=[rng.randrange(150_000) for _ in range(tokens)],
            response_logprobs=[-rng.random() * 4 for _ in range(tokens)],
            mem_span=(2, 40),
            action="search",
            query="query",
            information="Doc 1(Title: x) y",
        )

    trajs = [
        Trajectory(rounds=[one_round(i) for i in range(rounds)], p_mem=[0.5] * rounds, p_full=[0.4] * rounds)
        for _ in range(trajectories)
    ]
    return Group(group_id=task.group_id, task=task, trajectories=trajs, policy_version=0)


def encoded_size(group: Group, encoding: str) -> int:
    if encoding == "sidecar":
        text, blob = dump_with_sidecar(group)
        return len(text) + len(blob)
    return len(group.model_dump_json(context={"pack": encoding == "b64"}))


async def measure(url: str, reps: int, encoding: str, group: Group | None = None) -> dict[str, object]:
    redis = connect(url)
    queue = RedisQueue(redis, Keys("bench:"), consumer="bench")
    await queue.ensure_groups()
    group = group or make_group()
    size = encoded_size(group, encoding)

    # Same byte count, ASCII like the payload (the client decodes replies to str in both cases).
    blob = base64.b64encode(os.urandom(size))[:size]
    payload_times, raw_times = [], []
    for _ in range(reps):  # interleaved, so both see the same machine load
        started = time.perf_counter()
        if encoding == "sidecar":  # what RedisQueue.publish_group does
            await queue.publish_group(group)
        else:
            await redis.xadd(queue.keys.groups, {"data": group.model_dump_json(context={"pack": encoding == "b64"})})
        (delivery,) = await queue.claim_groups(1, block_ms=None)
        await queue.ack_groups([delivery.entry_id])
        payload_times.append(time.perf_counter() - started)
        assert delivery.record == group

        started = time.perf_counter()
        await redis.set("bench:raw", blob)
        assert len(await redis.get("bench:raw")) == size
        raw_times.append(time.perf_counter() - started)
    payload_s, raw_s = statistics.median(payload_times), statistics.median(raw_times)
    await redis.aclose()
    payload_mb_s = size / payload_s / 1e6
    raw_mb_s = size / raw_s / 1e6
    return {
        "payload_mb_s": round(payload_mb_s, 1),
        "raw_mb_s": round(raw_mb_s, 1),
        "ratio": round(payload_mb_s / raw_mb_s, 3),
        "payload_mb": round(size / 1e6, 3),
        "encoding": encoding,
        "ms_per_group": round(1000 * payload_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--encoding", choices=["sidecar", "b64", "plain"], default="sidecar",
        help="sidecar: JSON + raw array bytes (the queue's); b64: packed JSON; plain: JSON lists",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: checks it runs, proves nothing")
    args = parser.parse_args()
    group = None
    if args.smoke:  # one repetition of a 2 trajectories x 2 rounds x 64 tokens group
        args.reps, group = 1, make_group(trajectories=2, rounds=2, tokens=64)
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as server:
        result = asyncio.run(measure(server.url, args.reps, args.encoding, group))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
