"""The whole system as real processes, for the end-to-end and fault tests (no tests here).

``running_system`` starts a private redis-server (AOF on, so a restart keeps the streams)
and everything ``mempo up`` starts (retrieval, scorer, N CPU engines + N rollout workers,
learner) with ``mempo_cli.launcher.up.start_services`` on the tiny model, with small settings.
``System`` reads the state back from outside: the learner's /v1/status, the engines'
/model_info, the Redis streams and pending lists, the checkpoints on disk; ``Ledger``
checks that every admitted task is accounted for exactly once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import redis

from mempo.keys import LEARNER_GROUP, ROLLOUT_GROUP, Keys
from mempo.procs import RedisServer
from mempo.settings import merged
from mempo_cli.launcher.supervisor import Child, Supervisor
from mempo_cli.launcher.up import Endpoints, UpOptions, start_services

T = TypeVar("T")

GROUP_SIZE = 2  # rollouts per task
BATCH_GROUPS = 2  # groups per step; with max_staleness 0 also the in-flight bound

# Small and fast everywhere: 1-question tasks, 2 rounds, 32 new tokens a round, CPU only;
# the trainer's own defaults (no preset: the memory advantage on).
SERVICE_SETTINGS: dict[str, dict[str, Any]] = {
    "scorer": {"device": "cpu", "heartbeat_s": 1},
    "engine": {"drain_timeout_s": 2},
    "worker": {"max_new_tokens": 32, "heartbeat_s": 1, "drain_timeout_s": 5},
    "learner": {
        "preset": None, "device": "cpu", "poll_ms": 200, "drain_timeout_s": 20, "questions_per_task": [1],
        "group_size": GROUP_SIZE, "batch_groups": BATCH_GROUPS, "max_rounds": 2, "max_staleness": 0,
    },
}  # fmt: skip


@dataclass
class System:
    sup: Supervisor
    redis_server: RedisServer
    ends: Endpoints
    opts: UpOptions
    keys: Keys
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10.0))

    @property
    def run_dir(self) -> Path:
        return self.opts.run_dir.resolve()

    def child(self, name: str) -> Child:
        return next(c for c in self.sup.children if c.name == name)

    def redis(self, decode: bool = True) -> redis.Redis:
        return redis.Redis.from_url(self.redis_server.url, decode_responses=decode, socket_timeout=5)

    # ----------------------------------------------------------------- waiting

    def wait(self, what: str, probe: Callable[[], T | None], timeout_s: float, every_s: float = 0.2) -> T:
        """Poll ``probe`` until it returns something truthy; fail with the logs' tails."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = probe()
            except (httpx.HTTPError, redis.RedisError, ValueError, KeyError):
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{self.diagnosis()}")
            time.sleep(every_s)

    def wait_step(self, step: int, timeout_s: float = 90.0) -> dict[str, Any]:
        return self.wait(f"learner step {step}", lambda: (s := self.status())["step"] >= step and s, timeout_s)

    def diagnosis(self) -> str:
        parts = []
        try:
            parts.append(f"learner status: {self.status()}")
        except (httpx.HTTPError, ValueError) as exc:
            parts.append(f"learner status unavailable: {exc!r}")
        for child in self.sup.children:
            state = "alive" if child.alive() else f"exited {child.proc.returncode}"
            parts.append(f"--- {child.name} ({state}), last lines:\n{child.log_tail(8)}")
        return "\n".join(parts)

    # ----------------------------------------------------------------- reading state

    def status(self) -> dict[str, Any]:
        response = self.http.get(f"{self.ends.learner}/v1/status")
        response.raise_for_status()
        return dict(response.json())

    def weight_versions(self) -> dict[str, str]:
        """GET /model_info weight_version of the scorer and every engine."""
        urls = {"scorer": self.ends.scorer, **{f"engine-{i}": u for i, u in enumerate(self.ends.engines)}}
        return {name: str(self.http.get(f"{u}/model_info").json()["weight_version"]) for name, u in urls.items()}

    def worker_status(self, i: int) -> dict[str, Any]:
        return dict(self.http.get(f"{self.ends.workers[i]}/v1/status").json())

    def all_ready(self) -> bool:
        urls = [self.ends.retrieval, self.ends.scorer, self.ends.learner, *self.ends.engines, *self.ends.workers]
        return all(self.http.get(f"{u}/ready").status_code == 200 for u in urls)

    def pending(self, stream: str, group: str) -> list[dict[str, Any]]:
        """The stream's pending entries: message_id, consumer, times_delivered."""
        with self.redis() as r:
            return list(r.xpending_range(stream, group, min="-", max="+", count=1000))

    def pending_tasks(self, consumer: str | None = None) -> list[dict[str, Any]]:
        entries = self.pending(self.keys.tasks, ROLLOUT_GROUP)
        return [e for e in entries if consumer is None or e["consumer"] == consumer]

    def pending_groups(self) -> list[dict[str, Any]]:
        return self.pending(self.keys.groups, LEARNER_GROUP)

    def pending_group_ids(self) -> list[str]:
        """group_ids of the groups the learner has claimed and not acked."""
        ids = self.stream_group_ids(self.keys.groups)
        return [ids[e["message_id"]] for e in self.pending_groups() if e["message_id"] in ids]

    def stream_group_ids(self, stream: str) -> dict[str, str]:
        """Entry id -> group_id of every record in ``stream`` (tasks or groups)."""
        with self.redis(decode=False) as r:  # a group's sidecar blob is raw bytes
            entries = r.xrange(stream)
        return {i.decode(): _group_id(f.get(b"data", b"").decode(errors="replace")) for i, f in entries}

    def dead_letters(self) -> list[dict[str, str]]:
        with self.redis() as r:
            return [dict(fields, dead_id=entry_id) for entry_id, fields in r.xrange(self.keys.dead)]

    def dead_group_ids(self) -> set[str]:
        return {_group_id(d.get("data", "")) for d in self.dead_letters()} - {""}

    def learner_state(self) -> dict[str, str]:
        with self.redis() as r:
            return dict(r.hgetall(self.keys.learner_state))

    def checkpoints(self) -> dict[int, dict[str, Any]]:
        """step -> meta.json of every complete checkpoint on disk."""
        root = self.run_dir / "checkpoints"
        metas = [json.loads(p.read_text()) for p in root.glob("step-*/meta.json")] if root.is_dir() else []
        return {int(m["step"]): m for m in metas}

    def trained_ids(self) -> list[str]:
        """The group ids the latest checkpoint says were trained on (all steps so far)."""
        checkpoints = self.checkpoints()
        return list(checkpoints[max(checkpoints)]["trained_group_ids"]) if checkpoints else []

    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def ledger(self) -> Ledger:
        """Where every admitted task is now. Read the streams tasks first, then groups: a
        task moves by its group being published before the task is acked, so none is missed."""
        state = self.learner_state()
        queued = {*self.stream_group_ids(self.keys.tasks).values(), *self.stream_group_ids(self.keys.groups).values()}
        dead = {_group_id(d.get("data", "")): d.get("reason", "") for d in self.dead_letters()}
        run_id = state["run_id"]
        return Ledger(
            admitted=[f"{run_id}-g{i}" for i in range(int(state.get("admitted", 0)))],
            trained=self.trained_ids(),
            dead={g: why for g, why in dead.items() if g.startswith(f"{run_id}-")},
            queued={g for g in queued if g.startswith(f"{run_id}-")},
            consumed=int(state.get("consumed", 0)),
            dropped_stale=int(state.get("dropped_stale", 0)),
            dropped_duplicate=int(state.get("dropped_duplicate", 0)),
        )


@dataclass
class Ledger:
    """Every admitted task is trained once, dead with a reason, dropped as stale, or still
    queued (its task or group in a stream); ``problems`` lists what does not add up."""

    admitted: list[str]  # group ids {run_id}-g{i}, in admission order
    trained: list[str]  # the latest checkpoint's trained group ids
    dead: dict[str, str]  # group id -> reason
    queued: set[str]  # group ids of the records in the task and group streams
    consumed: int
    dropped_stale: int
    dropped_duplicate: int

    @property
    def in_flight(self) -> set[str]:
        """Queued and neither trained nor dead (a queued duplicate of a trained group is not)."""
        return self.queued - set(self.trained) - set(self.dead)

    def problems(self, steps: int, batch_groups: int, exact_counters: bool = True) -> list[str]:
        """``exact_counters=False`` after a learner crash between a checkpoint and its ack:
        the restarted learner drops that batch as duplicates, so ``consumed`` misses it."""
        out = []
        admitted, trained = set(self.admitted), set(self.trained)
        if len(trained) != len(self.trained):
            out.append(f"a group id twice in the checkpoint: {self.trained}")
        if len(self.trained) != steps * batch_groups:
            out.append(f"{len(self.trained)} groups trained in {steps} steps of {batch_groups}: one trained twice?")
        if exact_counters and self.consumed != len(trained):
            out.append(f"consumed counter {self.consumed} != {len(trained)} distinct groups trained")
        if not exact_counters and not self.consumed <= len(trained) <= self.consumed + self.dropped_duplicate:
            out.append(f"{len(trained)} trained, not within consumed {self.consumed} + duplicates {self.dropped_duplicate}")
        if stray := (trained | set(self.dead) | self.queued) - admitted:
            out.append(f"ids never admitted: {sorted(stray)}")
        if both := trained & set(self.dead):
            out.append(f"trained and dead: {sorted(both)}")
        missing = admitted - trained - set(self.dead) - self.queued
        if len(missing) != self.dropped_stale:
            out.append(f"unaccounted for: {sorted(missing)} (dropped as stale: {self.dropped_stale})")
        if self.dead and not all(self.dead.values()):
            out.append(f"a dead letter without a reason: {self.dead}")
        return out


def _group_id(data: str) -> str:
    """The group_id of a Task or Group record's JSON; "" for a malformed one."""
    try:
        value = json.loads(data)
    except ValueError:
        return ""
    if not isinstance(value, dict):
        return ""
    return str(value.get("group_id") or value.get("task", {}).get("group_id") or "")


@contextmanager
def running_system(
    root: Path,
    model: Path,
    *,
    steps: int,
    replicas: int = 2,
    given: dict[str, dict[str, Any]] | None = None,
) -> Iterator[System]:
    """Redis + every service of ``mempo up`` on ``model`` (``given``: settings per service
    over SERVICE_SETTINGS); everything stopped on exit."""
    settings = merged(merged(SERVICE_SETTINGS, {"learner": {"total_steps": steps}}), given or {})
    opts = UpOptions(
        name="system", rollout_replicas=replicas, runs_root=root, display=False, given=settings, ready_timeout_s=240
    )
    run = opts.run_dir.resolve()
    redis_server = RedisServer(run / "redis", appendonly=True).start()
    try:
        with Supervisor(run) as sup:
            ends = start_services(sup, opts, model, redis_server.url)
            system = System(sup, redis_server, ends, opts, Keys(ends.prefix))
            try:
                yield system
            finally:
                system.http.close()
    finally:
        redis_server.stop()
