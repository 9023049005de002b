"""Experiment tracking: one fan-out to the trackers RL engineers watch.

``Tracker(run_dir, backends)`` logs every step's figures (``log``), decoded sample
rollouts (``log_samples``) and ends with ``close``. The backends:

- ``jsonl`` (always on): samples to ``samples/step-<n>.jsonl``, and with ``journal`` the
  figures to ``metrics.jsonl`` (the learner keeps its own journal, under today's names);
- ``tensorboard``: event files in ``<run_dir>/tb/`` (``tensorboard --logdir runs``);
- ``wandb``: Weights & Biases, offline unless an API key is set or ``WANDB_MODE`` says
  otherwise (a run folder under ``<run_dir>/wandb/`` that ``wandb sync`` uploads later;
  never a login prompt);
- ``mlflow``: MLflow, on ``sqlite:///<run_dir>/mlflow.db`` unless ``MLFLOW_TRACKING_URI``
  is set.

Trackers get the names of ``NAMES`` (verl's where one exists, ``mem/`` for MemPO's own,
``rollout/`` for staleness, versions and rounds); a name not in it passes unchanged. A
backend that raises is reported once and dropped: a tracker never takes training down.
A restarted run continues the same tracker runs (ids kept in ``<run_dir>/tracking.json``)
and never logs a step twice.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

BACKENDS = ("jsonl", "tensorboard", "wandb", "mlflow")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # backend -> module
EXTRA = "mempo[tracking]"

# The journal's name -> the trackers' (verl's actor/, critic/, perf/, timing_s/ names).
NAMES: dict[str, str] = {
    "pg_loss": "actor/pg_loss", "pg_clipfrac": "actor/pg_clipfrac",
    "pg_clipfrac_lower": "actor/pg_clipfrac_lower", "ppo_kl": "actor/ppo_kl",
    "entropy": "actor/entropy", "grad_norm": "actor/grad_norm", "grad_norm_max": "actor/grad_norm_max",
    "lr": "actor/lr", "kl": "actor/kl_loss", "loss": "actor/loss",
    "optimizer_steps": "actor/optimizer_steps", "skipped_steps": "actor/skipped_steps",
    "reward_mean": "critic/score/mean", "adv_mean": "critic/advantages/mean",
    "adv_max": "critic/advantages/max", "adv_min": "critic/advantages/min",
    "adv_std": "critic/advantages/std", "adv_abs_max": "critic/advantages/abs_max",
    "adv_outcome_abs_mean": "critic/advantages/outcome_abs_mean",
    "zero_variance_group_frac": "critic/zero_variance_group_frac",
    "response_length_mean": "response_length/mean", "response_length_max": "response_length/max",
    "step_s": "timing_s/step", "step_time_s": "timing_s/update", "logprob_time_s": "timing_s/old_log_prob",
    "publish_s": "timing_s/publish", "tokens_per_s": "perf/throughput", "tokens": "perf/total_num_tokens",
    "tokens_total": "perf/total_num_tokens_with_prompts",
    "p_mem_mean": "mem/p_mem", "p_full_mean": "mem/p_full", "mem_reward_mean": "mem/reward_mean",
    "mem_reward_std": "mem/reward_std", "mem_adv_agreement": "mem/adv_agreement",
    "mem_pool_silenced_frac": "mem/pool_silenced_frac", "mem_token_frac": "mem/token_frac",
    "mem_items": "mem/items", "adv_memory_abs_mean": "mem/adv_abs_mean",
    "mem_reward_outcome_corr": "mem/reward_outcome_corr",
    "correct_rate": "rollout/correct_rate", "format_rate": "rollout/format_rate",
    "rounds_mean": "rollout/rounds_mean", "tokens_per_trajectory": "rollout/tokens_per_trajectory",
    "peak_tokens_per_trajectory": "rollout/peak_tokens_per_trajectory",
    "staleness_mean": "rollout/staleness_mean", "staleness_max": "rollout/staleness_max",
    "logprob_gap": "rollout/logprob_gap", "logprob_gap_max": "rollout/logprob_gap_max",
    "engines_updated": "rollout/engines_updated", "engines_stale": "rollout/engines_stale",
    "version": "rollout/policy_version", "groups": "rollout/groups",
    "trajectories": "rollout/trajectories", "sequences": "rollout/sequences",
}  # fmt: skip


def tracker_name(name: str) -> str:
    return NAMES.get(name, name)


class Backend(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int) -> None: ...

    def close(self) -> None: ...


def backend_names(value: Any) -> Any:
    """"tensorboard, wandb" -> ["tensorboard", "wandb"] (a list passes unchanged)."""
    return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value


def check_backends(names: Sequence[str]) -> list[str]:
    """``names`` checked before a run starts: each a known backend, its package installed;
    raises ValueError naming the problem (and the extra that installs it)."""
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown tracker {unknown[0]!r} (choose from {', '.join(BACKENDS)})")
    for name in names:
        if name != "jsonl" and not _installed(name):
            raise ValueError(f"tracker {name!r} needs the {PACKAGES[name]} package: pip install '{EXTRA}'")
    return ["jsonl", *(n for n in dict.fromkeys(names) if n != "jsonl")]


def _installed(backend: str) -> bool:
    """Whether ``backend``'s package imports (each import spelled out: the import graph
    sees them)."""
    try:
        if backend == "tensorboard":
            import tensorboard  # noqa: F401
        elif backend == "wandb":
            import wandb  # noqa: F401
        else:
            import mlflow  # noqa: F401
    except ImportError:
        return False
    return True


class Tracker:
    """The fan-out: ``backends`` (jsonl always), one run per ``run_dir``, resumed."""

    def __init__(
        self, run_dir: Path, backends: Sequence[str], name: str | None = None,
        config: Mapping[str, Any] | None = None, journal: bool = False, resume: bool = True,
    ) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.journal = journal
        self.state_path = self.run_dir / "tracking.json"
        self.state = _read_json(self.state_path) if resume else {}
        self.last_step = int(self.state.get("last_step", -1))
        self.backends: dict[str, Backend] = {}
        for backend in check_backends(backends):
            try:
                self.backends[backend] = _open(backend, self, name or self.run_dir.name, dict(config or {}))
            except Exception as exc:
                log.warning("tracker %s could not start (%s: %s); going on without it", backend, type(exc).__name__, exc)
        self._save()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """The step's numeric figures to every tracker, under NAMES; a step already logged
        (a restarted run trains it again) is skipped."""
        if step <= self.last_step:
            return
        figures = {tracker_name(k): float(v) for k, v in metrics.items() if _number(v) and k not in ("step", "time")}
        self._each("log", figures, step)
        self.last_step = step
        self._save()

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        """Decoded trajectories (mempo.samples.sample_rows) to every tracker."""
        self._each("log_samples", rows, step)

    def close(self) -> None:
        self._each("close")
        self.backends.clear()

    def _each(self, method: str, *args: Any) -> None:
        for name, backend in list(self.backends.items()):
            try:
                getattr(backend, method)(*args)
            except Exception as exc:
                log.warning("tracker %s failed (%s: %s); dropped for the rest of the run", name, type(exc).__name__, exc)
                del self.backends[name]

    def _save(self) -> None:
        self.state["last_step"] = self.last_step
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        os.replace(tmp, self.state_path)


def _open(backend: str, tracker: Tracker, name: str, config: dict[str, Any]) -> Backend:
    if backend == "jsonl":
        return Jsonl(tracker.run_dir, tracker.journal)
    if backend == "tensorboard":
        return TensorBoard(tracker.run_dir / "tb")
    if backend == "wandb":
        return WandB(tracker, name, config)
    return MLflow(tracker, name, config)


class Jsonl:
    """Samples as ``samples/step-<n>.jsonl``; with ``journal``, figures to ``metrics.jsonl``."""

    def __init__(self, run_dir: Path, journal: bool) -> None:
        self.folder = run_dir / "samples"
        self.journal = run_dir / "metrics.jsonl" if journal else None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self.journal is not None:
            import time

            with self.journal.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(row) + "\n" for row in rows)
        (self.folder / f"step-{step}.jsonl").write_text(text, encoding="utf-8")

    def close(self) -> None:
        pass


class TensorBoard:
    """Scalars and, for samples, one text entry per step (markdown)."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        from mempo.samples import markdown

        self.writer.add_text("samples", markdown(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run, resumed by the id kept in tracking.json; offline without an API key."""

    def __init__(self, tracker: Tracker, name: str, config: dict[str, Any]) -> None:
        import wandb

        if not os.environ.get("WANDB_MODE") and not os.environ.get("WANDB_API_KEY"):
            os.environ["WANDB_MODE"] = "offline"  # never a login prompt
        os.environ.setdefault("WANDB_SILENT", "true")
        run_id = tracker.state.setdefault("wandb_id", secrets.token_hex(4))
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "mempo"), name=name, id=run_id, resume="allow",
            dir=str(tracker.run_dir), config=config, reinit="create_new",
        )  # fmt: skip

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        import wandb

        from mempo.samples import COLUMNS, table_rows

        self.run.log({"samples": wandb.Table(columns=list(COLUMNS), data=table_rows(rows))}, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run in a local sqlite store (or MLFLOW_TRACKING_URI), its id kept."""

    def __init__(self, tracker: Tracker, name: str, config: dict[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        local = not os.environ.get("MLFLOW_TRACKING_URI")  # the run's own store and artifacts
        uri = f"sqlite:///{(tracker.run_dir / 'mlflow.db').resolve()}" if local else None
        self.client = MlflowClient(tracking_uri=uri)
        run_id = tracker.state.get("mlflow_run_id")
        if run_id is None:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "mempo")
            found = self.client.get_experiment_by_name(experiment)
            artifacts = (tracker.run_dir / "mlflow-artifacts").resolve().as_uri() if local else None
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment, artifacts)
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            for key, value in list(_flat(config).items())[:100]:
                self.client.log_param(run_id, key, str(value)[:500])
            tracker.state["mlflow_run_id"] = run_id
        else:
            self.client.update_run(run_id, status="RUNNING")  # a restarted run goes on
        self.run_id = run_id

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(name, value, now, step) for name, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_samples(self, rows: Sequence[Mapping[str, Any]], step: int) -> None:
        text = "".join(json.dumps(row) + "\n" for row in rows)
        self.client.log_text(self.run_id, text, f"samples/step-{step}.jsonl")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _number(value: Any) -> bool:
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
