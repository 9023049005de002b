"""The worker's Prometheus metrics and status counters, in one per-app registry."""

from __future__ import annotations

from prometheus_client import Gauge

from mempo.metrics import Metrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class WorkerMetrics:
    """Counters of episodes, rounds, tokens, tasks; round/task latency; what is in flight."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics or Metrics("rollout")
        m = self.metrics
        self._episodes = m.counter("episodes_total", "finished episodes", ("mode", "outcome"))
        self._rounds = m.counter("rounds_total", "generated rounds", ("action",))
        self._tokens = m.counter("tokens_total", "tokens the engine processed", ("kind",))
        self._tasks = m.counter("tasks_total", "handled tasks", ("outcome",))
        self._consume_errors = m.counter(
            "consume_errors_total", "failed claims of the consumer loop (it backs off and retries)", ("error",)
        )
        self._round_latency = m.histogram(
            "round_latency_seconds", "one round: generation + search", _LATENCY_BUCKETS
        )
        self._task_latency = m.histogram(
            "task_latency_seconds", "one task: n episodes + scoring", _LATENCY_BUCKETS
        )
        self._in_flight_episodes = Gauge(
            "mempo_rollout_in_flight_episodes", "episodes running now", registry=m.registry
        )
        self._in_flight_tasks = Gauge(
            "mempo_rollout_in_flight_tasks", "tasks running now", registry=m.registry
        )
        # Plain totals for GET /v1/status (Prometheus counters are not meant to be read back).
        self.episodes = self.rounds = self.tokens = self.tasks_done = self.tasks_failed = 0
        self.in_flight_episodes = self.in_flight_tasks = self.consume_errors = 0

    def round_done(self, action: str, prompt_tokens: int, response_tokens: int, seconds: float) -> None:
        self._rounds.labels(action).inc()
        self._tokens.labels("prompt").inc(prompt_tokens)
        self._tokens.labels("response").inc(response_tokens)
        self._round_latency.observe(seconds)
        self.rounds += 1
        self.tokens += prompt_tokens + response_tokens

    def episode_started(self) -> None:
        self.in_flight_episodes += 1
        self._in_flight_episodes.inc()

    def episode_finished(self, mode: str, outcome: str | None) -> None:
        """``outcome`` None: the episode failed (an upstream error), it is not counted."""
        self.in_flight_episodes -= 1
        self._in_flight_episodes.dec()
        if outcome is not None:
            self._episodes.labels(mode, outcome).inc()
            self.episodes += 1

    def task_started(self) -> None:
        self.in_flight_tasks += 1
        self._in_flight_tasks.inc()

    def task_finished(self, ok: bool, seconds: float) -> None:
        self.in_flight_tasks -= 1
        self._in_flight_tasks.dec()
        self._tasks.labels("ok" if ok else "failed").inc()
        if ok:
            self.tasks_done += 1
            self._task_latency.observe(seconds)
        else:
            self.tasks_failed += 1

    def consume_failed(self, error: str) -> None:
        self._consume_errors.labels(error).inc()
        self.consume_errors += 1
