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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mempo.procs import RedisServer, free_port
from mempo.settings import ServiceSettings, merged
from mempo_cli.launcher.progress import Progress, Snapshot
from mempo_cli.launcher.supervisor import Child, ChildFailed, Supervisor
from services.learner.settings import LearnerSettings
from services.retrieval.settings import RetrievalSettings
from services.rollout.engine.settings import EngineSettings
from services.rollout.settings import WorkerSettings
from services.scorer.settings import ScorerSettings

log = logging.getLogger(__name__)

SERVICES: dict[str, type[ServiceSettings]] = {
    "retrieval": RetrievalSettings,
    "scorer": ScorerSettings,
    "engine": EngineSettings,
    "worker": WorkerSettings,
    "learner": LearnerSettings,
}
PRESET = "tiny"  # the learner's and the workers' recipe (their settings' PRESETS)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # every child but the learner


class UpOptions(BaseModel):
    """``mempo up``'s own options; every other one is a service's setting (``given``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(default_factory=lambda: time.strftime("up-%Y%m%d-%H%M%S"), min_length=1)
    """Run name: runs/<name>/ (default: a timestamp)."""

    model: Path | None = None
    """Policy (HF folder); default: the tiny model, SFT warm-started."""

    rollout_replicas: int = Field(default=1, ge=1, le=16)
    """CPU engine + worker pairs."""

    heldout: bool = True
    """Score every held-out question before and after RL (greedy)."""

    seed: int = 0
    """Sampling, task order and initialisation."""

    world_seed: int = 0
    """The agent's world; the warm start learns it and the next 7."""

    runs_root: Path = Path("runs")
    """Where run folders go."""

    display: bool = True
    """Live progress (a table on a terminal)."""

    ready_timeout_s: float = Field(default=300.0, gt=0)
    """How long a service may take to become ready."""

    given: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Settings per service (SERVICES' names), over what the launcher sets."""

    @field_validator("model")
    @classmethod
    def _hf_folder(cls, model: Path | None) -> Path | None:
        if model is not None and not (model / "config.json").exists():
            raise ValueError(f"{model} is not an HF model folder (no config.json)")
        return model

    @property
    def run_dir(self) -> Path:
        return self.runs_root / self.name


def service_settings(opts: UpOptions, service: str, **values: Any) -> Any:
    """``service``'s settings: what ``opts.given`` names for it over the launcher's
    ``values``, over the tiny preset where the service has one; the environment's
    ``MEMPO_*`` variables over the preset too, as in any service process."""
    cls = SERVICES[service]
    base = {"preset": PRESET, **values} if "preset" in cls.model_fields else values
    return cls(**merged(base, opts.given.get(service, {})))


@dataclass
class Plan:
    """Every child's settings, built here and handed over as its environment."""

    retrieval: RetrievalSettings
    scorer: ScorerSettings
    engines: list[EngineSettings]
    workers: list[WorkerSettings]
    learner: LearnerSettings


def local_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def plan(opts: UpOptions, model: Path, redis_url: str) -> Plan:
    """The settings of every service of the run. One secret per service, given only to the
    children that need it: the scorer's and the workers' tokens (the learner holds both),
    each engine's own key (its worker alone holds it: the learner updates an engine through
    its worker)."""
    run = opts.run_dir.resolve()
    weights = str(run / "weights")
    redis = {"redis_url": redis_url}
    if os.environ.get("MEMPO_REDIS_URL"):  # a shared Redis: one key prefix per run
        redis["key_prefix"] = f"mempo:{opts.name}:"
    scorer_token, worker_token = secrets.token_hex(16), secrets.token_hex(16)
    retrieval = service_settings(opts, "retrieval", port=free_port(), world_seed=opts.world_seed)
    scorer_port = free_port()
    scorer = service_settings(
        opts, "scorer", port=scorer_port, model_path=str(model), weights_root=weights,
        admin_token=scorer_token, public_url=local_url(scorer_port), engine_id="scorer-0", **redis,
    )  # fmt: skip
    learner = service_settings(
        opts, "learner", port=free_port(), model_path=str(model), run_dir=run,
        checkpoint_dir=run / "checkpoints", weights_root=weights, worker_admin_token=worker_token,
        scorer_admin_token=scorer_token, task_seed=opts.seed, world_seed=opts.world_seed,
        trainer={"seed": opts.seed}, **redis,
    )  # fmt: skip
    engines, workers = [], []
    for i in range(opts.rollout_replicas):
        key, port = secrets.token_hex(16), free_port()
        engines.append(service_settings(
            opts, "engine", port=free_port(), model_path=str(model), weights_root=weights,
            admin_token=key, threads=1, seed=opts.seed + i,
        ))  # fmt: skip
        workers.append(service_settings(
            opts, "worker", port=port, worker_id=f"worker-{i}", engine_url=local_url(engines[-1].port),
            engine_admin_token=key, admin_token=worker_token, retrieval_url=local_url(retrieval.port),
            scorer_url=local_url(scorer_port) if learner.mode == "memory" else "",
            public_url=local_url(port), tokenizer_path=str(model), **redis,
        ))  # fmt: skip
    return Plan(retrieval, scorer, engines, workers, learner)


@dataclass
class Endpoints:
    retrieval: str
    scorer: str
    learner: str
    engines: list[str]
    workers: list[str]
    prefix: str = "mempo:"  # the run's Redis key prefix


def start_services(sup: Supervisor, opts: UpOptions, model: Path, redis_url: str) -> Endpoints:
    """Start every service as a child process and wait until all are ready."""
    p = plan(opts, model, redis_url)
    (opts.run_dir.resolve() / "weights").mkdir(parents=True, exist_ok=True)
    first: list[Child] = [
        sup.start_service("retrieval", "retrieval serve", p.retrieval, ONE_THREAD),
        sup.start_service("scorer", "scorer serve", p.scorer, ONE_THREAD),
        *(
            sup.start_service(f"engine-{i}", "rollout engine", e, ONE_THREAD)
            for i, e in enumerate(p.engines)
        ),
    ]
    sup.wait_ready(first, opts.ready_timeout_s)
    second = [
        *(
            sup.start_service(f"worker-{i}", "rollout worker", w, ONE_THREAD)
            for i, w in enumerate(p.workers)
        ),
        sup.start_service("learner", "learner serve", p.learner),
    ]
    sup.wait_ready(second, opts.ready_timeout_s)
    return Endpoints(
        local_url(p.retrieval.port), local_url(p.scorer.port), local_url(p.learner.port),
        [local_url(e.port) for e in p.engines], [local_url(w.port) for w in p.workers], p.learner.key_prefix,
    )  # fmt: skip


def snapshot(http: httpx.Client, ends: Endpoints) -> Snapshot:
    """Read the learner's status and every engine's weight version."""
    status = http.get(f"{ends.learner}/v1/status").json()
    versions = {}
    for name, base in [
        ("scorer", ends.scorer),
        *[(f"engine-{i}", u) for i, u in enumerate(ends.engines)],
    ]:
        try:
            versions[name] = str(http.get(f"{base}/model_info").json().get("weight_version"))
        except (httpx.HTTPError, ValueError):
            versions[name] = "?"
    return Snapshot(status=status, versions=versions, at=time.monotonic())


def monitor(
    sup: Supervisor, ends: Endpoints, opts: UpOptions, steps: int, progress: Progress
) -> dict[str, Any]:
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
                raise ChildFailed(
                    f"the learner failed: {snap.status.get('error')} (log: {opts.run_dir / 'logs' / 'learner.log'})"
                )
            # Done: the learner says so, or has taken its steps and every engine has the last version.
            caught_up = all(v == str(snap.status.get("version")) for v in snap.versions.values())
            if state == "finished" or (snap.status.get("step", 0) >= steps and caught_up):
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
    steps = service_settings(opts, "learner").total_steps
    try:
        if not redis_url:
            redis = RedisServer(
                run / "redis", appendonly=True, password=secrets.token_hex(16)
            ).start()
            redis_url = redis.url
        with (
            Supervisor(run) as sup,
            Progress(steps, enabled=opts.display, heading=heading) as progress,
        ):
            progress.note(f"starting services (logs in {run / 'logs'})")
            ends = start_services(sup, opts, model, redis_url)
            progress.note("all services ready; training")
            final = monitor(sup, ends, opts, steps, progress)
            progress.note("done; stopping services")
    finally:
        if redis is not None:
            redis.stop()
    final["wall_s"] = round(time.monotonic() - started, 1)
    return final
