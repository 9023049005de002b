"""docker/redis-conf.sh's ACL users on a real redis-server: each role can do what its
service does (the queue's own calls) and nothing it should not."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import NoPermissionError

from mempo.keys import Keys
from mempo.procs import free_port
from mempo.queue import RedisQueue, connect
from mempo.registry import EngineInfo
from mempo.schemas import Task
from tests.core.test_schemas import make_group

REPO = Path(__file__).resolve().parents[2]
ROLES = ("learner", "rollout", "scorer")


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """A redis-server on the compose stacks' configuration: (port, role -> password)."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    passwords = {role: secrets.token_hex(16) for role in ("default", *ROLES)}
    env = {"PATH": os.environ["PATH"], "REDIS_PASSWORD": passwords["default"]}
    env |= {f"REDIS_{role.upper()}_PASSWORD": passwords[role] for role in ROLES}
    conf = tmp_path / "redis.conf"
    conf.write_text(subprocess.run(["sh", str(REPO / "docker/redis-conf.sh")], env=env, check=True,
                                   capture_output=True, text=True).stdout)  # fmt: skip
    assert not any(p in conf.read_text() for p in passwords.values())  # hashed
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode != 0:
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)
        yield port, passwords
    finally:
        proc.terminate()
        proc.wait(10)


def role_queue(port: int, role: str, password: str, consumer: str) -> RedisQueue:
    return RedisQueue(connect(f"redis://{role}@127.0.0.1:{port}/0", password), Keys(), consumer=consumer)


async def test_each_role_does_its_service_s_work_and_nothing_else(acl_redis: tuple[int, dict[str, str]]) -> None:
    port, passwords = acl_redis
    learner, rollout, scorer = (role_queue(port, r, passwords[r], r) for r in ROLES)
    try:
        # the learner: streams, state, policy, registry
        await learner.ensure_groups()
        await learner.admit_tasks([Task(questions=["q"], answers=[["a"]], n=2)])
        await learner.set_policy(1, "/weights/v1")
        await learner.set_state(step=1)
        # a rollout worker: claim, renew, publish, ack, fail, register, read the policy
        await rollout.ensure_groups()
        delivery = await rollout.claim_task(block_ms=None)
        assert delivery is not None and await rollout.renew_task(delivery.entry_id)
        await rollout.publish_group(make_group())
        await rollout.record_failure(delivery.entry_id, "once")
        await rollout.ack_task(delivery.entry_id)
        assert (await rollout.get_policy()).version == 1  # type: ignore[union-attr]
        await rollout.register_engine(EngineInfo(id="w", url="http://w:8003"))
        # the scorer: its registration and the policy pointer
        await scorer.register_engine(EngineInfo(id="s", role="scorer", url="http://s:8002"))
        assert (await scorer.get_policy()).version == 1  # type: ignore[union-attr]
        await scorer.unregister_engine("s")
        # the learner reads what they wrote
        (group,) = await learner.claim_groups(4, block_ms=None)
        await learner.ack_groups([group.entry_id])
        assert [e.id for e in await learner.list_engines()] == ["w"]
        assert (await learner.stream_lengths())["groups"] == 0
        # what a leaked worker or scorer secret must not allow
        forbidden = [
            rollout.set_policy(9, "/evil"),
            rollout.add_to_state(consumed=100),
            scorer.claim_task(block_ms=None),
            scorer.publish_group(make_group()),
            scorer.set_policy(9, "/evil"),
            learner.redis.flushall(),
            rollout.redis.config_get("requirepass"),
        ]
        for attempt in forbidden:
            with pytest.raises(NoPermissionError):
                await attempt
        assert (await learner.get_policy()).path == "/weights/v1"  # type: ignore[union-attr]
    finally:
        for q in (learner, rollout, scorer):
            await q.aclose()
            await q.redis.aclose()
