"""Weights by broadcast through the real services (``weight_sync = broadcast``): the
learner, 2 CPU engines behind their workers, the scorer, redis, as processes. Every
version reaches both engines over gloo (in many small buckets) and the scorer from disk;
an engine killed in the middle of a broadcast (frozen between two of its buckets, then
kill -9) is left out, the other ends on the whole version and the run goes on;
restarted, it catches up from disk and takes broadcasts again."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mempo.settings import merged
from tests.e2e.conftest import FAULT_SETTINGS
from tests.e2e.system import System, running_system

pytestmark = pytest.mark.e2e

BROADCAST_SETTINGS = merged(FAULT_SETTINGS, {
    "learner": {"weight_sync": "broadcast", "publish_timeout_s": 20,
                "weight_sync_bucket_mb": 0.05},  # about 60 buckets a version
})  # fmt: skip
RECEIVED = re.compile(r"received \d+ tensors by broadcast \(weight version (\S+)\)")


@pytest.fixture(scope="module")
def system(e2e_root: Path, tiny_model_dir: Path) -> Iterator[System]:
    with running_system(e2e_root, tiny_model_dir, steps=100_000, given=BROADCAST_SETTINGS) as s:
        yield s


def publish_after(s: System, version: int) -> dict[str, object]:
    """The learner's report of the first publish past ``version``."""
    def published() -> dict[str, object] | None:
        last = s.status().get("last_publish")
        return last if last and last["version"] > version else None

    return s.wait(f"a publish after v{version}", published, timeout_s=120)


def test_every_version_reaches_the_engines_by_broadcast(system: System) -> None:
    s = system
    s.wait_step(2, timeout_s=180)
    report = publish_after(s, 1)
    workers, scorer = s.ends.workers, s.ends.scorer
    assert report["stale"] == {}, report
    assert report["paths"] == {workers[0]: "broadcast", workers[1]: "broadcast", scorer: "disk"}, report
    version = int(str(report["version"]))
    s.wait("every engine and the scorer at the published version (or the next)",
           lambda: min(int(v) for v in s.weight_versions().values()) >= version or None,
           timeout_s=30)  # fmt: skip
    assert "joined weight-update group" in s.child("engine-0").log_tail(200)


def freeze_mid_broadcast(s: System) -> int:
    """SIGSTOP engine-1 between two buckets of a broadcast (a bucket of the next version
    received, not its last one); the version engine-1 held."""
    engine = s.child("engine-1")
    for _ in range(20):
        held = s.weight_versions()["engine-1"]
        offset = engine.log_path.stat().st_size
        deadline = time.monotonic() + 120
        while not RECEIVED.search(engine.log_path.read_bytes()[offset:].decode(errors="replace")):
            assert time.monotonic() < deadline, f"no broadcast reached engine-1\n{s.diagnosis()}"
            time.sleep(0.005)
        s.sup.kill(engine, signal.SIGSTOP)
        seen = RECEIVED.findall(engine.log_path.read_bytes()[offset:].decode(errors="replace"))
        if seen[-1] == held:  # the version moves with the last bucket only: mid-broadcast
            return int(held)
        s.sup.kill(engine, signal.SIGCONT)  # caught it after the last bucket: next version
    raise AssertionError(f"never caught engine-1 in the middle of a broadcast\n{s.diagnosis()}")


def test_an_engine_killed_mid_broadcast_is_left_out_then_catches_up(system: System) -> None:
    s = system
    engine = s.child("engine-1")
    version = freeze_mid_broadcast(s)
    time.sleep(1.0)
    s.sup.kill(engine)  # kill -9 in the middle of the broadcast
    report = publish_after(s, version)
    worker0, worker1 = s.ends.workers
    # The broadcast failed for both; engine-0 got the whole version from disk instead.
    assert report["paths"][worker0] == "disk" and worker0 not in report["stale"], report
    assert worker1 in report["stale"], report  # neither broadcast nor disk reached it
    engine0 = s.http.get(f"{s.ends.engines[0]}/model_info").json()["weight_version"]
    assert int(engine0) >= int(str(report["version"])), engine0
    # held paused while it may have held a part of the version, resumed once it was whole
    assert not s.http.get(f"{s.ends.engines[0]}/server_info").json()["paused"]
    # The run goes on, engine-0 by broadcast again (a new group without engine-1).
    later = publish_after(s, int(str(report["version"])))
    assert later["paths"][worker0] == "broadcast" and worker0 not in later["stale"], later
    s.sup.restart(engine)  # a late joiner: its worker loads the policy from disk first
    s.sup.wait_ready([engine], timeout_s=120)

    def broadcast_to_worker1() -> dict[str, object] | None:
        last = s.status()["last_publish"]
        reached = last["paths"].get(worker1) == "broadcast" and worker1 not in last["stale"]
        return last if reached else None

    rejoined = int(str(s.wait("a publish that reaches the restarted engine by broadcast",
                              broadcast_to_worker1, timeout_s=180)["version"]))  # fmt: skip
    s.wait("engine-1 at the learner's version",
           lambda: int(s.weight_versions()["engine-1"]) >= rejoined or None, timeout_s=30)  # fmt: skip
