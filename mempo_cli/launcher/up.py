"""``mempo up``: the whole loop on one machine, CPU only, no set-up.

A private redis-server (or ``MEMPO_REDIS_URL``), the retrieval service, the scorer, N CPU
engines with N rollout workers, and the learner, each a child process with its own log
in ``runs/<name>/logs/``. It waits for every ``/ready``, shows live progress until the
learner has taken ``--steps`` steps, and stops everything cleanly (the CLI then scores
the held-out set and writes plots).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from mempo.procs import RedisServer, free_port
from mempo_cli.launcher.progress import Progress, Snapshot
from mempo_cli.launcher.supervisor import Child, ChildFailed, Supervisor

log = logging.getLogger(__name__)


@dataclass
class UpOptions:
    name: str
    steps: int = 20
    rollout_replicas: int = 1
    model: Path | None = None  # None: the tiny model, SFT warm-started
    runs_root: Path = Path("runs")
    questions_per_task: str = "1-2"
    group_size: int = 8
    batch_groups: int = 4
    mode: str = "memory"
    max_rounds: int = 6
    max_new_tokens: int = 256  # per round (the worker's default, 512, suits real models)
    max_staleness: int = 1
    lr: float | None = None
    warmup_steps: int | None = None
    decay_steps: int | None = None  # train steps of a cosine LR decay (0: constant LR)
    ppo_epochs: int | None = None  # passes over each step's batch
    beta_kl: float | None = None  # weight of the KL penalty to the reference (the starting policy)
    alpha: float | None = None  # memory advantage weight (0: plain GRPO)
    mem_min_std: float | None = None  # pools with a smaller std: no memory advantage
    neg_adv_scale: float | None = None  # negative advantages multiplied by this
    mem_loss: str | None = None  # shared | span-mean: how the <mem> tokens' loss is aggregated
    weight_sync: str = "disk"  # disk | broadcast: how the rollout engines get each version
    reward: str | None = None  # em | fraction | f1: the workers' outcome reward (None: theirs, em)
    seed: int = 0
    world_seed: int = 0  # the agent's world (retrieval's corpus, the learner's tasks)
    display: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)  # every child: under the defaults
    # Per service ("retrieval", "scorer", "engine", "worker", "learner"): over the defaults.
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    ready_timeout_s: float = 300.0

    @property
    def run_dir(self) -> Path:
        return self.runs_root / self.name


@dataclass
class Endpoints:
    retrieval: str
    scorer: str
    learner: str
    engines: list[str]
    workers: list[str]
    prefix: str = "mempo:"  # the run's Redis key prefix


def _env(base: dict[str, str], **values: object) -> dict[str, str]:
    return {**base, **{k: str(v) for k, v in values.items() if v is not None}}


def _over(opts: UpOptions, service: str, env: dict[str, str]) -> dict[str, str]:
    return {**env, **opts.service_env.get(service, {})}


def start_services(sup: Supervisor, opts: UpOptions, model: Path, redis_url: str) -> Endpoints:
    """Start every service as a child process and wait until all are ready."""
    run = opts.run_dir.resolve()
    # One secret per service, only in the environments of the children that need it: the
    # scorer's and the workers' tokens (the learner holds both), each engine's own key
    # (its worker alone holds it: the learner updates an engine through its worker).
    scorer_token, worker_token = secrets.token_hex(16), secrets.token_hex(16)
    weights = run / "weights"
    weights.mkdir(parents=True, exist_ok=True)
    prefix = "mempo:" if not os.environ.get("MEMPO_REDIS_URL") else f"mempo:{opts.name}:"
    one_thread = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **opts.extra_env}
    ports = {name: free_port() for name in ("retrieval", "scorer", "learner")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}

    first: list[Child] = [
        sup.start("retrieval", ["mempo", "retrieval", "serve"], url=url["retrieval"], env=_over(
            opts, "retrieval", _env(one_thread, MEMPO_RETRIEVAL_PORT=ports["retrieval"],
            MEMPO_RETRIEVAL_WORLD_SEED=opts.world_seed))),
        sup.start("scorer", ["mempo", "scorer", "serve"], url=url["scorer"], env=_over(opts, "scorer", _env(
            one_thread, MEMPO_SCORER_PORT=ports["scorer"], MEMPO_SCORER_MODEL_PATH=model,
            MEMPO_SCORER_WEIGHTS_ROOT=weights, MEMPO_SCORER_ADMIN_TOKEN=scorer_token,
            MEMPO_SCORER_REDIS_URL=redis_url, MEMPO_SCORER_KEY_PREFIX=prefix,
            MEMPO_SCORER_PUBLIC_URL=url["scorer"], MEMPO_SCORER_ENGINE_ID="scorer-0"))),
    ]
    engines, workers = [], []
    engine_keys = [secrets.token_hex(16) for _ in range(opts.rollout_replicas)]
    for i in range(opts.rollout_replicas):
        port = free_port()
        engines.append(f"http://127.0.0.1:{port}")
        first.append(sup.start(f"engine-{i}", ["mempo", "rollout", "engine"], url=engines[-1], env=_over(
            opts, "engine", _env(
                one_thread, MEMPO_ENGINE_PORT=port, MEMPO_ENGINE_MODEL_PATH=model,
                MEMPO_ENGINE_HOST="127.0.0.1", MEMPO_ENGINE_WEIGHTS_ROOT=weights,
                MEMPO_ENGINE_ADMIN_TOKEN=engine_keys[i],
                MEMPO_ENGINE_THREADS=1, MEMPO_ENGINE_SEED=opts.seed + i))))
    sup.wait_ready(first, opts.ready_timeout_s)

    second: list[Child] = []
    for i, engine in enumerate(engines):
        port = free_port()
        workers.append(f"http://127.0.0.1:{port}")
        second.append(sup.start(f"worker-{i}", ["mempo", "rollout", "worker"], url=workers[-1], env=_over(
            opts, "worker", _env(
                one_thread, MEMPO_ROLLOUT_PORT=port, MEMPO_ROLLOUT_REDIS_URL=redis_url,
                MEMPO_ROLLOUT_KEY_PREFIX=prefix, MEMPO_ROLLOUT_WORKER_ID=f"worker-{i}",
                MEMPO_ROLLOUT_ENGINE_URL=engine, MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN=engine_keys[i],
                MEMPO_ROLLOUT_ADMIN_TOKEN=worker_token,
                MEMPO_ROLLOUT_RETRIEVAL_URL=url["retrieval"],
                MEMPO_ROLLOUT_SCORER_URL=url["scorer"] if opts.mode == "memory" else "",
                MEMPO_ROLLOUT_PUBLIC_URL=workers[-1], MEMPO_ROLLOUT_TOKENIZER_PATH=model,
                MEMPO_ROLLOUT_CLAIM_IDLE_MS=60_000, MEMPO_ROLLOUT_MAX_NEW_TOKENS=opts.max_new_tokens,
                MEMPO_ROLLOUT_REWARD_KIND=opts.reward))))
    learner_env = _env(
        opts.extra_env, MEMPO_LEARNER_PORT=ports["learner"], MEMPO_LEARNER_REDIS_URL=redis_url,
        MEMPO_LEARNER_KEY_PREFIX=prefix, MEMPO_LEARNER_MODEL_PATH=model, MEMPO_LEARNER_RUN_DIR=run,
        MEMPO_LEARNER_CHECKPOINT_DIR=run / "checkpoints", MEMPO_LEARNER_WEIGHTS_ROOT=weights,
        MEMPO_LEARNER_WORKER_ADMIN_TOKEN=worker_token, MEMPO_LEARNER_SCORER_ADMIN_TOKEN=scorer_token,
        MEMPO_LEARNER_TOTAL_STEPS=opts.steps,
        MEMPO_LEARNER_QUESTIONS_PER_TASK=opts.questions_per_task, MEMPO_LEARNER_GROUP_SIZE=opts.group_size,
        MEMPO_LEARNER_BATCH_GROUPS=opts.batch_groups, MEMPO_LEARNER_MODE=opts.mode,
        MEMPO_LEARNER_MAX_ROUNDS=opts.max_rounds, MEMPO_LEARNER_MAX_STALENESS=opts.max_staleness,
        MEMPO_LEARNER_TASK_SEED=opts.seed, MEMPO_LEARNER_WORLD_SEED=opts.world_seed,
        MEMPO_LEARNER_TRAINER__LR=opts.lr,
        MEMPO_LEARNER_TRAINER__WARMUP_STEPS=opts.warmup_steps,
        MEMPO_LEARNER_TRAINER__DECAY_STEPS=opts.decay_steps, MEMPO_LEARNER_TRAINER__PPO_EPOCHS=opts.ppo_epochs,
        MEMPO_LEARNER_TRAINER__BETA_KL=opts.beta_kl,
        MEMPO_LEARNER_TRAINER__ALPHA=opts.alpha, MEMPO_LEARNER_TRAINER__SEED=opts.seed,
        MEMPO_LEARNER_TRAINER__MEM_MIN_STD=opts.mem_min_std,
        MEMPO_LEARNER_TRAINER__NEG_ADV_SCALE=opts.neg_adv_scale,
        MEMPO_LEARNER_TRAINER__MEM_LOSS=opts.mem_loss, MEMPO_LEARNER_WEIGHT_SYNC=opts.weight_sync,
    )
    second.append(sup.start("learner", ["mempo", "learner", "serve"], url=url["learner"],
                            env=_over(opts, "learner", learner_env)))
    sup.wait_ready(second, opts.ready_timeout_s)
    return Endpoints(url["retrieval"], url["scorer"], url["learner"], engines, workers, prefix)


def snapshot(http: httpx.Client, ends: Endpoints) -> Snapshot:
    """Read the learner's status and every engine's weight version."""
    status = http.get(f"{ends.learner}/v1/status").json()
    versions = {}
    for name, base in [("scorer", ends.scorer), *[(f"engine-{i}", u) for i, u in enumerate(ends.engines)]]:
        try:
            versions[name] = str(http.get(f"{base}/model_info").json().get("weight_version"))
        except (httpx.HTTPError, ValueError):
            versions[name] = "?"
    return Snapshot(status=status, versions=versions, at=time.monotonic())


def monitor(sup: Supervisor, ends: Endpoints, opts: UpOptions, progress: Progress) -> dict[str, Any]:
    """Show progress until the learner is done; returns its final status."""
    with httpx.Client(timeout=5.0) as http:
        while True:
            sup.check()
            try:
                snap = snapshot(http, ends)
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("status unavailable: %s", exc)
                time.sleep(1.0)
                continue
            progress.update(snap)
            state = snap.status.get("state")
            if state == "failed":
                raise ChildFailed(f"the learner failed: {snap.status.get('error')} (log: {opts.run_dir / 'logs' / 'learner.log'})")
            # Done: the learner says so, or has taken its steps and every engine has the last version.
            caught_up = all(v == str(snap.status.get("version")) for v in snap.versions.values())
            if state == "finished" or (snap.status.get("step", 0) >= opts.steps and caught_up):
                return dict(snap.status)
            time.sleep(1.0)


def run_up(opts: UpOptions, model: Path, heading: str = "") -> dict[str, Any]:
    """Run the loop; returns the learner's final status. Cleans up on any exit.
    ``heading`` is shown above the live progress (the held-out score so far)."""
    run = opts.run_dir
    run.mkdir(parents=True, exist_ok=True)
    redis: RedisServer | None = None
    redis_url = os.environ.get("MEMPO_REDIS_URL")
    started = time.monotonic()
    try:
        if not redis_url:
            redis = RedisServer(run / "redis", appendonly=True, password=secrets.token_hex(16)).start()
            redis_url = redis.url
        with Supervisor(run) as sup, Progress(opts.steps, enabled=opts.display, heading=heading) as progress:
            progress.note(f"starting services (logs in {run / 'logs'})")
            ends = start_services(sup, opts, model, redis_url)
            progress.note("all services ready; training")
            final = monitor(sup, ends, opts, progress)
            progress.note("done; stopping services")
    finally:
        if redis is not None:
            redis.stop()
    final["wall_s"] = round(time.monotonic() - started, 1)
    return final
