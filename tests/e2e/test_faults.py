"""Fault tests on one running system (tests/e2e/system.py): kill -9 a rollout worker
mid-group, kill -9 the learner (before and after its checkpoint), restart redis-server,
take the scorer away, feed poison records; then account for every admitted task.

The tests share one system, in file order; each first waits until the system trains
again. Faults are placed deterministically: SIGSTOP freezes a process at the moment
that matters (a worker's engine while its episodes run, the learner holding a batch it
has not checkpointed), so the state is read, then SIGKILL lands exactly there.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from mempo.arrays import LogProbs, TokenIds, dump_with_sidecar
from mempo.schemas import Group, Round, Task, Trajectory
from mempo_cli.launcher.supervisor import Child
from tests.e2e.system import BATCH_GROUPS, System

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def healed(fault_system: System) -> System:
    """Undo what a failed earlier test may have left (a frozen or dead process, redis
    down), so each test meets a whole system; a test checks its own crashes itself."""
    s = fault_system
    if s.redis_server.proc is None or s.redis_server.proc.poll() is not None:
        s.redis_server.start()
    for child in s.sup.children:
        s.sup.kill(child, signal.SIGCONT)
        if (not child.alive() and child.name != "learner") or (not child.alive() and s.checkpoints()):
            s.sup.restart(child)
    s.sup.wait_ready(s.sup.children, timeout_s=120)
    return s


def training(s: System, steps: int = 1, timeout_s: float = 90.0) -> int:
    """Every process alive and ready, and the learner ``steps`` further; its step then."""
    s.sup.check()
    s.wait("every service ready", s.all_ready, timeout_s=60)
    return int(s.wait_step(s.status()["step"] + steps, timeout_s)["step"])


def log_since(child: Child, offset: int) -> str:
    with child.log_path.open("rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace")


def freeze_learner_holding_a_batch(s: System) -> list[str]:
    """SIGSTOP the learner while it holds a full batch of claimed groups that no
    checkpoint holds yet (it is training them); returns their group ids."""
    learner = s.child("learner")
    for _ in range(30):  # a busy machine often catches it after the checkpoint
        s.wait("the learner to claim a batch", lambda: len(s.pending_groups()) == BATCH_GROUPS,
               timeout_s=60, every_s=0.02)  # fmt: skip
        s.sup.kill(learner, signal.SIGSTOP)
        held = s.pending_group_ids()
        if len(held) == BATCH_GROUPS and not set(held) & set(s.trained_ids()):
            return held
        s.sup.kill(learner, signal.SIGCONT)  # caught it after the checkpoint: next batch
    raise AssertionError(f"never caught the learner holding an untrained batch\n{s.diagnosis()}")


def restart_learner(s: System) -> str:
    """Start the learner again (same settings, same consumer name); its new log lines."""
    learner = s.child("learner")
    offset = learner.log_path.stat().st_size
    s.sup.restart(learner)
    s.sup.wait_ready([learner], timeout_s=120)
    return log_since(learner, offset)


def resumed_step(log_text: str) -> int:
    found = re.findall(r"resumed at step (\d+)", log_text)
    assert found, f"the restarted learner did not resume from a checkpoint:\n{log_text[-2000:]}"
    return int(found[-1])


# --------------------------------------------------------------------------- rollout worker


def test_a_worker_killed_mid_group_has_its_task_finished_by_the_other(fault_system: System) -> None:
    s = fault_system
    training(s)
    worker, engine = s.child("worker-0"), s.child("engine-0")
    # Catch worker-0 mid-group: it holds a task and its episodes wait on its (frozen) engine.
    for _ in range(20):
        s.wait("worker-0 to claim a task", lambda: s.pending_tasks("worker-0"), timeout_s=60, every_s=0.02)
        s.sup.kill(engine, signal.SIGSTOP)
        held = s.pending_tasks("worker-0")
        if held and s.worker_status(0)["in_flight_episodes"] > 0:
            entry = held[0]["message_id"]
            break
        s.sup.kill(engine, signal.SIGCONT)
    else:
        raise AssertionError(f"never caught worker-0 mid-group\n{s.diagnosis()}")
    group_id = s.stream_group_ids(s.keys.tasks)[entry]
    s.sup.kill(worker)  # kill -9, mid-group: nothing published, the task not acked
    s.sup.kill(engine, signal.SIGCONT)
    assert [e["message_id"] for e in s.pending_tasks("worker-0")] == [entry]

    owners: set[str] = set()

    def finished_elsewhere() -> bool:
        owners.update(e["consumer"] for e in s.pending_tasks() if e["message_id"] == entry)
        return entry not in s.stream_group_ids(s.keys.tasks)  # acked, hence deleted

    # After claim_idle_ms (3 s) worker-1 reclaims the task, runs it and acks it; with
    # worker-0 dead, only worker-1 can have acked it (it is not in the dead stream).
    s.wait("the task to be reclaimed and finished", finished_elsewhere, timeout_s=60, every_s=0.05)
    assert "worker-1" in owners, owners
    assert group_id not in s.dead_group_ids()
    s.wait("its group to be trained", lambda: group_id in s.trained_ids(), timeout_s=60)

    s.sup.restart(worker)  # same id: it rejoins the consumer group and the registry
    s.sup.wait_ready([worker], timeout_s=120)
    training(s)


# --------------------------------------------------------------------------- learner


def test_the_learner_killed_before_its_checkpoint_resumes_and_trains_the_batch_once(
    fault_system: System,
) -> None:
    s = fault_system
    training(s)
    held = freeze_learner_holding_a_batch(s)
    last = max(s.checkpoints())
    trained = set(s.trained_ids())
    dropped_before = int(s.learner_state().get("dropped_duplicate", 0))
    s.sup.kill(s.child("learner"))  # kill -9 mid-step: the batch is claimed, not checkpointed
    assert sorted(s.pending_group_ids()) == sorted(held)  # still pending under learner-0

    assert resumed_step(restart_learner(s)) == last
    # The restart reads back its pending groups first and trains them as the next step.
    nxt = s.wait(f"checkpoint {last + 1}", lambda: s.checkpoints().get(last + 1), timeout_s=90)
    assert set(nxt["trained_group_ids"]) == trained | set(held)
    assert int(s.learner_state().get("dropped_duplicate", 0)) == dropped_before
    training(s)


def test_the_learner_killed_after_its_checkpoint_drops_the_batch_as_duplicates(
    fault_system: System,
) -> None:
    s = fault_system
    training(s)
    learner, engine = s.child("learner"), s.child("engine-1")
    held = freeze_learner_holding_a_batch(s)
    dropped_before = int(s.learner_state().get("dropped_duplicate", 0))
    # With engine-1 frozen the learner trains, checkpoints, and then waits in the publish:
    # the batch is durable in the checkpoint, but its groups are not acked.
    s.sup.kill(engine, signal.SIGSTOP)
    s.sup.kill(learner, signal.SIGCONT)
    s.wait("the checkpoint holding the batch", lambda: set(held) <= set(s.trained_ids()), timeout_s=60)
    last = max(s.checkpoints())
    s.sup.kill(learner)  # kill -9 between the checkpoint and the ack
    s.sup.kill(engine, signal.SIGCONT)
    assert sorted(s.pending_group_ids()) == sorted(held)

    assert resumed_step(restart_learner(s)) == last
    # The redelivered batch is recognised from the checkpoint's ids: dropped, not retrained.
    s.wait("the batch dropped as duplicates",
           lambda: int(s.learner_state().get("dropped_duplicate", 0)) == dropped_before + BATCH_GROUPS,
           timeout_s=60)  # fmt: skip
    nxt = s.wait(f"checkpoint {last + 1}", lambda: s.checkpoints().get(last + 1), timeout_s=90)
    new = set(nxt["trained_group_ids"]) - set(s.checkpoints()[last]["trained_group_ids"])
    assert len(new) == BATCH_GROUPS and not new & set(held)
    training(s)


# --------------------------------------------------------------------------- redis


def test_every_service_reconnects_after_redis_restarts(fault_system: System) -> None:
    s = fault_system
    training(s)
    pids = {c.name: c.proc.pid for c in s.sup.children}
    offsets = {c.name: c.log_path.stat().st_size for c in s.sup.children}
    before = s.learner_state()
    s.redis_server.stop()  # SIGTERM: redis writes its AOF out, so no state is lost
    time.sleep(4.0)  # every Redis client hits the outage
    s.sup.check()  # nobody crashed meanwhile
    s.redis_server.start()  # same port, same data directory
    after = s.learner_state()  # the run and its counters survived (AOF)
    assert after["run_id"] == before["run_id"] and int(after["admitted"]) >= int(before["admitted"])
    training(s, steps=2)
    assert {c.name: c.proc.pid for c in s.sup.children} == pids  # alive throughout, never restarted

    logs = {name: log_since(s.child(name), offset) for name, offset in offsets.items()}
    retries = {
        "learner": r"Redis: .*retrying in",
        # the claim loop, the registry heartbeat, or a finished task's publish / ack
        "worker-0": r"cannot claim tasks|registry heartbeat failed|a (group|task) failed .*retry",
        "worker-1": r"cannot claim tasks|registry heartbeat failed|a (group|task) failed .*retry",
        "scorer": r"registry heartbeat failed .*retrying in",
    }
    for name, pattern in retries.items():
        count = len(re.findall(pattern, logs[name]))
        # It noticed the outage, and backed off: a few retries in 4 s, not a busy loop.
        assert 1 <= count <= 40, f"{name}: {count} retries\n{logs[name][-3000:]}"
    delays = [float(d) for d in re.findall(r"Redis: .*retrying in ([\d.]+)s", logs["learner"])]
    assert delays and max(delays) <= 30.0, delays  # the learner's cap
    assert "Traceback" not in "".join(logs.values())


# --------------------------------------------------------------------------- scorer


def test_rollout_retries_the_scorer_and_recovers_when_it_returns(fault_system: System) -> None:
    s = fault_system
    training(s)
    scorer = s.child("scorer")
    offsets = {name: s.child(name).log_path.stat().st_size for name in ("worker-0", "worker-1")}
    failed_before = sum(s.worker_status(i)["tasks_failed"] for i in (0, 1))
    s.sup.stop(scorer)
    # Each scoring call is retried (5 attempts, backoff); then the task goes back to the queue.
    s.wait("a worker to give a task back",
           lambda: sum(s.worker_status(i)["tasks_failed"] for i in (0, 1)) > failed_before,
           timeout_s=60)  # fmt: skip
    with s.redis() as r:
        failures = dict(r.hgetall(s.keys.failures))
    assert failures and all("scorer" in why for why in failures.values()), failures
    tasks = s.stream_group_ids(s.keys.tasks)
    given_back = {tasks[entry] for entry in failures if entry in tasks}
    assert given_back, (failures, tasks)
    step = int(s.status()["step"])

    s.sup.restart(scorer)  # same port; it loads mempo:policy by its heartbeat
    s.sup.wait_ready([scorer], timeout_s=120)
    s.wait("two more steps", lambda: s.status()["step"] >= step + 2, timeout_s=90)
    s.wait("the given-back tasks trained", lambda: given_back <= set(s.trained_ids()), timeout_s=60)
    assert not given_back & s.dead_group_ids()
    retried = "".join(log_since(s.child(n), o) for n, o in offsets.items())
    assert re.search(r"POST \S+/v1/memory-scores failed .*retry 1/4", retried), retried[-3000:]
    version = int(s.status()["version"])
    s.wait(f"the scorer at version {version} or later",
           lambda: int(s.weight_versions()["scorer"]) >= version, timeout_s=30)  # fmt: skip


# --------------------------------------------------------------------------- poison records


def untrainable_group(group_id: str, vocab_size: int, version: int) -> Group:
    """A well-formed group whose response holds a token id the model does not have."""
    task = Task(task_id=f"{group_id}-t", group_id=group_id, questions=["who?"], answers=[["x"]], n=1)
    bad_round = Round(index=0, prompt_ids=TokenIds([1, 2, 3]), response_ids=TokenIds([vocab_size + 7]),
                      response_logprobs=LogProbs([-1.0]), action="answer")  # fmt: skip
    return Group(group_id=group_id, task=task, trajectories=[Trajectory(rounds=[bad_round])],
                 policy_version=version)  # fmt: skip


def test_poison_records_end_in_the_dead_stream_with_a_reason(fault_system: System, tiny_model_dir: Path) -> None:
    s = fault_system
    step = training(s)
    vocab = int(json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"])
    text, blob = dump_with_sidecar(untrainable_group("poison-g3", vocab, int(s.status()["version"])))
    records = [
        (s.keys.tasks, {"data": b"{not json"}, "malformed Task record"),
        (s.keys.tasks, {"data": b'{"task_id": "poison-t1", "questions": []}'}, "malformed Task record"),
        (s.keys.groups, {"data": b'{"group_id": "poison-g2"}'}, "malformed Group record"),
        (s.keys.groups, {"data": text, "blob": blob}, "untrainable group: trajectory"),
    ]
    with s.redis(decode=False) as r:  # entry ids are per stream: key them by (stream, id)
        poison = {(stream, r.xadd(stream, fields).decode()): why for stream, fields, why in records}

    def dead_poison() -> dict[tuple[str, str], str] | None:
        letters = s.dead_letters()
        dead = {(d["stream"], d["entry_id"]): d["reason"] for d in letters if (d["stream"], d["entry_id"]) in poison}
        return dead if len(dead) == len(poison) else None

    dead = s.wait("every poison record in the dead stream", dead_poison, timeout_s=60)
    for key, why in poison.items():
        assert dead[key].startswith(why), (key, dead[key])
    assert f"token id {vocab + 7}, outside the model's vocabulary" in dead[list(poison)[3]]
    left = {(s.keys.tasks, e) for e in s.stream_group_ids(s.keys.tasks)}
    left |= {(s.keys.groups, e) for e in s.stream_group_ids(s.keys.groups)}
    assert not set(poison) & left  # acked where they were: nothing redelivers them
    assert training(s) > step  # nothing crashed: every process alive, training goes on
    assert "poison-g3" not in s.trained_ids()


# --------------------------------------------------------------------------- the books


def test_after_every_fault_each_admitted_task_is_accounted_for(fault_system: System) -> None:
    s = fault_system
    training(s)
    s.sup.stop(s.child("learner"))  # clean stop: the running step finishes, nothing new is admitted
    s.wait("the workers to finish the admitted tasks",
           lambda: not s.pending_tasks() and not s.stream_group_ids(s.keys.tasks), timeout_s=60)  # fmt: skip
    steps = max(s.checkpoints())
    ledger = s.ledger()
    # exact_counters=False: the kill after the checkpoint left one batch counted as duplicates
    assert not ledger.problems(steps, BATCH_GROUPS, exact_counters=False), ledger.problems(
        steps, BATCH_GROUPS, exact_counters=False
    )
    assert ledger.dropped_duplicate >= BATCH_GROUPS
    assert len(ledger.in_flight) <= BATCH_GROUPS  # at most the last admitted batch waits
    # One metrics line per step, none twice; a step cut off between its checkpoint and its
    # ack (the second learner kill; redis going away mid-publish) has none and is missing
    # from ``consumed`` too: its batch came back and was dropped as duplicates.
    rows = s.metrics()
    logged = [r["step"] for r in rows]
    assert logged == sorted(set(logged)) and logged[-1] == steps, logged
    assert sum(r["groups"] for r in rows) == len(logged) * BATCH_GROUPS
    cut_off = steps - len(logged)
    assert len(ledger.trained) - ledger.consumed == cut_off * BATCH_GROUPS <= ledger.dropped_duplicate
