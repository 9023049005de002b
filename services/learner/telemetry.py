"""The learner's Prometheus metrics, its ``metrics.jsonl`` journal (one line per step) and
the step log that feeds the journal, the trackers and the decoded samples."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

from mempo.metrics import Metrics
from mempo.schemas import Group
from mempo.tracking import Tracker

log = logging.getLogger(__name__)


class LearnerMetrics(Metrics):
    """Request metrics plus the training loop's: steps, groups, publishes, staleness."""

    def __init__(self) -> None:
        super().__init__("learner")
        self.steps = self.counter("steps_total", "training steps completed")
        self.groups_consumed = self.counter("groups_consumed_total", "groups trained on")
        self.groups_dropped = self.counter(
            "groups_dropped_total", "groups dropped unseen by the trainer", ("reason",)
        )
        self.tasks_admitted = self.counter("tasks_admitted_total", "tasks fed to the rollout")
        self.skipped_steps = self.counter(
            "skipped_steps_total", "optimizer steps skipped for a non-finite loss or gradient"
        )
        self.failed_batches = self.counter(
            "failed_batches_total", "batches whose step raised (trainer restored, groups dead-lettered)"
        )
        self.redis_errors = self.counter(
            "redis_errors_total", "loop restarts on a Redis error or a malformed key", ("error",)
        )
        self.publish_failures = self.counter(
            "publish_failures_total", "engine weight updates that failed (engine left stale)"
        )
        self.step_seconds = self.histogram(
            "step_seconds", "wall time of a training step (train, checkpoint, publish, ack)"
        )
        self.publish_seconds = self.histogram("publish_seconds", "wall time of a weight publish")
        self.version = Gauge(
            "mempo_learner_policy_version", "policy version", registry=self.registry
        )
        self.in_flight = Gauge(
            "mempo_learner_tasks_in_flight",
            "tasks admitted and not yet trained on or dropped",
            registry=self.registry,
        )
        self.staleness = Gauge(
            "mempo_learner_staleness_versions",
            "mean staleness of the last batch",
            registry=self.registry,
        )


class MetricsJournal:
    """Appends one JSON object per step to ``run_dir/metrics.jsonl``."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"

    def write(self, step: int, version: int, metrics: dict[str, float]) -> dict[str, Any]:
        record: dict[str, Any] = {"step": step, "version": version, "time": time.time()}
        for name, value in sorted(metrics.items()):
            record.setdefault(name, _finite(value))  # the step's own step/version stay ints
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        return record

    def last(self) -> dict[str, Any] | None:
        """The last complete line (what a restarted learner reports until its next step)."""
        if not self.path.exists():
            return None
        for line in reversed(self.path.read_text(encoding="utf-8").splitlines()):
            try:
                value = json.loads(line)
            except ValueError:
                continue  # a line torn by a crash
            if isinstance(value, dict):
                return value
        return None


def _finite(value: float) -> float | None:
    """JSON has no NaN/inf: a non-finite metric is written as null."""
    value = float(value)
    return value if math.isfinite(value) else None


class StepLog:
    """Each step's figures to the journal (today's names) and the trackers (mempo.tracking's
    names); every ``sample_every`` steps, ``samples`` trajectories of the step decoded."""

    def __init__(self, settings: Any) -> None:
        self.journal = MetricsJournal(settings.run_dir)
        config = settings.model_dump(mode="json")  # secrets come out masked
        self.tracker = Tracker(settings.run_dir, settings.tracking, settings.run_dir.name, config)
        self.sample_every, self.samples = settings.sample_every, settings.sample_trajectories
        self.tokenizer_path = settings.resolved_model_path()
        self._tokenizer: Any = None

    def write(self, step: int, version: int, figures: dict[str, float], groups: list[Group]) -> dict[str, Any]:
        record = self.journal.write(step, version, figures)
        self.tracker.log(record, step)
        if self.samples and self.sample_every and step % self.sample_every == 0:
            self._samples(step, groups)
        return record

    def _samples(self, step: int, groups: list[Group]) -> None:
        from mempo.samples import sample_rows

        try:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            rows = sample_rows(self._tokenizer, groups, self.samples)
        except Exception as exc:
            log.warning("no samples at step %d (%s: %s)", step, type(exc).__name__, exc)
            return
        self.tracker.log_samples(rows, step)

    def close(self) -> None:
        self.tracker.close()
