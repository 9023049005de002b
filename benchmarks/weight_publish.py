"""Weight publishing: the learner's publish to 2 CPU engines and the scorer vs a plain copy,
on the disk path and on the broadcast path.

A publish is what the learner does after every step: the trainer exports HF safetensors
to ``weights_root/v{n}/`` (temp dir + rename), ``mempo:policy`` moves, and every
registered engine and the scorer load the version (``/update_weights_from_disk``, in
parallel), then old versions are deleted. The engines and the scorer run as separate
processes, as in a deployment. The baseline, measured in the same run on the same disk,
is ``shutil.copytree`` of the published folder. Each publish is checked: every
process's ``/model_info`` must report the new version (those requests, sent at once, are
also ``http_floor_s``: the fixed cost no publish over HTTP can go below; for the 0.7M
``test`` preset it is about 3x the copy, so its ratio cannot reach 2). Then the same with
``weight_sync = broadcast``: the engines get the tensors over gloo (services/learner/
broadcast.py; the scorer still loads the folder): ``broadcast_s`` is the engines' push,
``broadcast_ratio`` it over the copy. Prints one JSON line: {"publish_s", "copy_s",
"ratio", "broadcast_s", "broadcast_ratio", "load_ratio", ...}. Goals: ratio <= 2,
broadcast_ratio <= 1.

``load_owned_s`` is what a receiver's load of a published (sealed) version costs in this
process: mempo.weights.load_checked, which reads every tensor into memory of its own so
that nothing served aliases the file; ``load_mapped_s`` the zero-copy load it replaced
(map_safetensors and the same checks), whose pages are only read when first used;
``load_ratio`` the first over the second, the same folder in the same run.

    python benchmarks/weight_publish.py [--preset medium|large|reader|test] [--reps 9]
    python benchmarks/weight_publish.py --smoke   # seconds-scale sizes: checks it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import torch

from mempo.keys import Keys
from mempo.procs import RedisServer, free_port, wait_ready
from mempo.queue import RedisQueue, connect
from mempo.registry import EngineInfo
from mempo_sim.tiny import PRESETS, TinyConfig, default_cache_dir, ensure_tiny

TOKEN = secrets.token_hex(16)  # the services refuse short or placeholder admin secrets
MODELS = {
    **PRESETS,
    # ~27M parameters, 108 MB of float32 safetensors
    "medium": TinyConfig(
        hidden_size=512, layers=8, heads=8, kv_heads=4, intermediate_size=1536, vocab_size=3072
    ),
    # ~102M parameters, 409 MB: where the bytes, not the fixed costs, decide
    "large": TinyConfig(
        hidden_size=1024, layers=8, heads=16, kv_heads=8, intermediate_size=3072, vocab_size=3072
    ),
}


# Versions kept on disk, as the learner's default. The first KEEP + 2 publishes are not
# timed: a training run publishes every step, and until the memory of deleted versions
# comes around again each export writes into memory the page cache has not used before,
# which on this VM is 2-8x slower to write (70-220 ms against 28 ms for 104 MB: versions
# 1-4 of a run; measured 2026-12-07). The copy never pays it: it deletes what it wrote
# right away, so each copy reuses the pages of the one before.
KEEP = 2
WARM_UP = KEEP + 2

# Each receiver one thread, as ``mempo up`` starts every service on a machine this small:
# three processes with a thread per core each oversubscribe 2 cores (notify 0.85 s, not 0.1).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    handle = log.open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "mempo_cli", *args],
        env={**os.environ, **ONE_THREAD, **env},
        stdout=handle,
        stderr=subprocess.STDOUT,
    )


def launch_fleet(stack: ExitStack, model: Path, root: Path, logs: Path) -> list[str]:
    """Two CPU engines and the scorer as processes; their URLs once all are ready."""
    urls, procs = [], []
    for i in range(3):
        port = free_port()
        common = ["--port", str(port), "--model-path", str(model), "--weights-root", str(root)]
        if i < 2:
            proc = start(
                ["rollout", "engine", *common],
                {"MEMPO_ENGINE_ADMIN_TOKEN": TOKEN},
                logs / f"engine{i}.log",
            )
        else:
            proc = start(
                ["scorer", "serve", *common, "--device", "cpu"],
                {"MEMPO_SCORER_ADMIN_TOKEN": TOKEN},
                logs / "scorer.log",
            )
        stack.callback(_stop, proc)
        urls.append(f"http://127.0.0.1:{port}")
        procs.append(proc)
    for url, proc in zip(urls, procs, strict=True):
        wait_ready(url, timeout_s=300, proc=proc)
    return urls


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


async def publish_and_copy(
    publisher: Any, exporter: Any, version: int, urls: list[str], http: httpx.AsyncClient
) -> dict[str, float]:
    """One publish, checked on every receiver, then a plain copy of the same folder."""
    started = time.perf_counter()
    report = await publisher.publish(exporter, version)
    elapsed = time.perf_counter() - started
    if report.stale:
        raise RuntimeError(f"engines failed to load v{version}: {report.stale}")
    started = time.perf_counter()  # one request to every receiver at once: HTTP's floor
    replies = await asyncio.gather(*(http.get(f"{u}/model_info") for u in urls))
    floor = time.perf_counter() - started
    versions = [reply.json()["weight_version"] for reply in replies]
    if versions != [str(version)] * len(urls):
        raise RuntimeError(f"after publishing v{version} the fleet reports {versions}")
    target = Path(report.path).with_name(f"copy-{version}")
    started = time.perf_counter()
    shutil.copytree(report.path, target)
    copied = time.perf_counter() - started
    shutil.rmtree(target)
    receivers = {f"receiver{i}_s": report.seconds[url] for i, url in enumerate(urls)}
    return {
        "publish_s": elapsed,
        "copy_s": copied,
        "export_s": report.export_s,
        "notify_s": report.notify_s,
        "http_floor_s": floor,
        "broadcast_s": report.broadcast_s,
        **receivers,
        "bytes": folder_bytes(Path(report.path)),
    }


def measure_load(folder: Path, root: Path, model: Any, reps: int) -> dict[str, float]:
    """Medians of a receiver's load of ``folder`` (sealed) in this process, read into
    owned tensors (what the services run) and mapped (zero-copy), alternately."""
    from mempo.weights import check_weights, is_sealed, load_checked, map_safetensors

    expected = model.state_dict()

    def mapped() -> Any:
        state = map_safetensors(folder, root)
        check_weights(state, expected, str(folder), finite=not is_sealed(folder))
        return state

    def owned() -> Any:
        return load_checked(folder, expected, root)

    times: dict[str, list[float]] = {"owned": [], "mapped": []}
    for _ in range(max(reps, 3)):
        for name, load in (("owned", owned), ("mapped", mapped)):
            started = time.perf_counter()
            state = load()
            times[name].append(time.perf_counter() - started)
            del state
    return {name: statistics.median(values) for name, values in times.items()}


def summary(
    paths: dict[str, dict[str, float]], loads: dict[str, float], each: dict[str, list[float]]
) -> dict[str, Any]:
    """The figures of the JSON line from the medians of each path (``paths``), a receiver's
    loads and every disk publish's time (``each``)."""
    disk, sent = paths["disk"], paths["broadcast"]
    return {
        "publish_s": round(disk["publish_s"], 4),
        "copy_s": round(disk["copy_s"], 4),
        "ratio": round(disk["publish_s"] / disk["copy_s"], 3),
        "export_s": round(disk["export_s"], 4),
        "notify_s": round(disk["notify_s"], 4),
        "engine_s": [round(disk["receiver0_s"], 4), round(disk["receiver1_s"], 4)],
        "scorer_s": round(disk["receiver2_s"], 4),
        # a GET /model_info to every receiver at once: no publish that waits for each one's
        # answer over HTTP is faster (for the 0.7M presets this alone is about 3x the copy)
        "http_floor_s": round(disk["http_floor_s"], 4),
        # broadcast: the engines' push alone, and the whole publish (+ the disk for the scorer)
        "broadcast_s": round(sent["broadcast_s"], 4),
        # over the disk phase's copy: one baseline for both ratios (the broadcast phase's
        # copies run beside its disk write, which the disk phase's copies do too, but
        # measured 2-3x slower there)
        "broadcast_ratio": round(sent["broadcast_s"] / disk["copy_s"], 3),
        "broadcast_publish_s": round(sent["publish_s"], 4),
        # a receiver's load of one version: read into owned tensors against mapped
        "load_owned_s": round(loads["owned"], 4),
        "load_mapped_s": round(loads["mapped"], 5),
        "load_ratio": round(loads["owned"] / loads["mapped"], 1),
        "publish_each_s": each["disk"],  # the first WARM_UP are not timed
        "bytes": int(disk["bytes"]),
    }


async def measure(
    model: Path, urls: list[str], redis_url: str, root: Path, reps: int
) -> dict[str, Any]:
    """The disk path's publishes, then the broadcast path's, each against its copies."""
    from services.learner.checkpoint import TrainerExporter
    from services.learner.publish import WeightPublisher
    from services.learner.trainer import Trainer
    from services.learner.trainer_config import TrainerConfig

    trainer = Trainer(TrainerConfig(beta_kl=0.0), model)  # no reference copy: only export matters
    with torch.no_grad():  # as after a first optimizer step: the loaded parameters view the
        for param in trainer.policy.parameters():  # model file copy-on-write, which the
            param.mul_(1.0)  # kernel may drop and read again; written, they are our memory
    exporter = TrainerExporter(trainer)  # what the learner's loop hands the publisher
    redis = connect(redis_url)
    queue = RedisQueue(redis, Keys("bench:"))
    for i, url in enumerate(urls):
        info = EngineInfo(id=f"p{i}", role="scorer" if i == 2 else "rollout", url=url)
        await queue.register_engine(info.signed(TOKEN), ttl_s=3600)  # as the services sign
    paths: dict[str, dict[str, float]] = {}
    each: dict[str, list[float]] = {}  # every publish, the warm-up ones first
    loads: dict[str, float] = {}
    version = 0
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            for path in ("disk", "broadcast"):
                publisher = WeightPublisher(
                    queue, root, admin_token=TOKEN, timeout_s=600, keep_versions=KEEP,
                    broadcast=path == "broadcast",
                )  # fmt: skip
                try:
                    runs = []
                    for _ in range(WARM_UP + reps):
                        version += 1
                        runs.append(await publish_and_copy(publisher, exporter, version, urls, http))
                finally:
                    await publisher.aclose()
                timed = runs[WARM_UP:]
                paths[path] = {name: statistics.median(run[name] for run in timed) for name in runs[0]}
                each[path] = [round(run["publish_s"], 4) for run in runs]
                if path == "disk":  # the last version is still on disk, in the page cache
                    loads = measure_load(root / f"v{version}", root, trainer.policy, reps)
    finally:
        await queue.aclose()
        await redis.aclose()
    return {
        **summary(paths, loads, each),
        "params": sum(p.numel() for p in trainer.policy.parameters()),
        "receivers": len(urls),
        "reps": reps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(MODELS), default="medium")
    parser.add_argument("--reps", type=int, default=9, help="timed publishes (the median is kept)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: checks it runs, proves nothing")
    args = parser.parse_args()
    if args.smoke:  # the random-weight test model; the warm-up publishes and one timed
        args.preset, args.reps = "test", 1
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = ensure_tiny(default_cache_dir(), MODELS[args.preset])
    with tempfile.TemporaryDirectory(prefix="mempo-publish-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        root = work / "weights"
        redis = stack.enter_context(RedisServer(work / "redis"))
        urls = launch_fleet(stack, model, root, work)
        result = asyncio.run(measure(model, urls, redis.url, root, args.reps))
    print(json.dumps({"preset": args.preset, **result}))


if __name__ == "__main__":
    main()
