"""The learner loop on the real trainer and tiny model: a step end to end, exactly-once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mempo.keys import Keys
from mempo.queue import RedisQueue
from mempo.schemas import Group, Task
from mempo.weights import map_safetensors, non_finite
from services.learner import loop as learner_loop
from services.learner.loop import LearnerLoop
from services.learner.settings import LearnerSettings
from services.learner.trainer_config import TrainerConfig
from tests.services.learner.service_support import StandInEngine, make_group


class SimulatedCrash(Exception):
    """The process dies here."""


def learner_settings(
    redis_url: str, keys: Keys, tmp_path: Path, model: Path, **overrides: Any
) -> LearnerSettings:
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "key_prefix": keys.prefix,
        "model_path": str(model),
        "device": "cpu",
        "run_dir": tmp_path / "run",
        "weights_root": tmp_path / "weights",
        "batch_groups": 2,
        "group_size": 2,
        "max_rounds": 3,
        "poll_ms": 50,
        "trainer": TrainerConfig(warmup_steps=0, mini_batches=1, lr=1e-3),
        **overrides,
    }
    return LearnerSettings(**values)


async def roll_out(queue: RedisQueue, version: int, **group: Any) -> int:
    """A rollout worker in burst mode: every admitted task becomes a group at ``version``."""
    done = 0
    while (delivery := await queue.claim_task(block_ms=None)) is not None:
        await queue.publish_group(make_group(delivery.record, version, seed=done, **group))
        await queue.ack_task(delivery.entry_id)
        done += 1
    return done


def parameters(loop: LearnerLoop) -> dict[str, torch.Tensor]:
    policy = loop.trainer.policy  # type: ignore[attr-defined]
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


async def test_one_step_trains_checkpoints_publishes_acks_and_admits(
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    queue: RedisQueue,
    fleet: list[StandInEngine],
) -> None:
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir)
    loop = await LearnerLoop.open(settings, queue)
    try:
        await loop.admit()
        assert await roll_out(queue, version=0) == 2
        before = parameters(loop)
        record = await loop.training_step()
        assert record is not None
        after = parameters(loop)
        assert any(not torch.equal(before[k], after[k]) for k in before)
        assert (loop.trainer.step, loop.trainer.version) == (1, 1)
        for engine in fleet:
            assert [c["weight_version"] for c in engine.calls] == ["1"]
        policy = await queue.get_policy()
        assert policy is not None and policy.path == str(tmp_path / "weights" / "v1")
        assert (Path(policy.path) / "model.safetensors").exists()
        assert list((tmp_path / "run" / "checkpoints").glob("step-00000001"))
        lengths = await queue.stream_lengths()
        assert lengths["groups"] == 0 and lengths["tasks"] == 2  # acked; the next batch admitted
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == [record]
        for name in (
            "reward_mean",
            "correct_rate",
            "format_rate",
            "p_mem_mean",
            "p_full_mean",
            "mem_reward_mean",
            "pg_clipfrac",
            "kl",
            "entropy",
            "grad_norm",
            "tokens_per_s",
            "staleness_mean",
            "publish_s",
            "step_s",
            "engines_updated",
        ):
            assert isinstance(record[name], float), name
        assert record["step"] == 1 and record["engines_updated"] == 3.0
        assert record["pg_clipfrac"] == 0.0  # recomputed old log-probs, one mini-batch: ratio 1
    finally:
        await loop.aclose()


@pytest.mark.parametrize("crash_at", ["checkpoint", "publish", "ack"])
async def test_each_group_is_trained_exactly_once_across_a_crash(
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    queue: RedisQueue,
    fleet: list[StandInEngine],
    crash_at: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kill the loop just before the checkpoint, the publish or the ack; restart it."""
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir)
    loop = await LearnerLoop.open(settings, queue)
    await loop.admit()
    await roll_out(queue, version=0)

    def crash(*args: object, **kwargs: object) -> None:
        raise SimulatedCrash(crash_at)

    target = {"checkpoint": learner_loop, "publish": loop.publisher, "ack": loop.consumer}[crash_at]
    method = {"checkpoint": "save_trainer", "publish": "publish", "ack": "ack"}[crash_at]
    with monkeypatch.context() as patch, pytest.raises(SimulatedCrash):
        patch.setattr(target, method, crash)
        await loop.training_step()
    trained = parameters(loop)
    await loop.aclose()

    again = await LearnerLoop.open(settings, RedisQueue(queue.redis, keys, consumer="learner-0"))
    try:
        checkpointed = crash_at != "checkpoint"
        assert again.trainer.step == int(checkpointed)
        # a crash after the checkpoint but before the publish: the restart publishes it
        assert [c["weight_version"] for c in fleet[0].calls] == (["1"] if checkpointed else [])
        if checkpointed:
            assert all(torch.equal(trained[k], v) for k, v in parameters(again).items())
        record = await again.training_step()  # the redelivered groups
        counts = await again.state.counts()
        if checkpointed:
            assert record is None  # dropped: already trained
            assert (counts.dropped_duplicate, counts.consumed) == (2, 0)
        else:
            assert record is not None and record["step"] == 1  # trained now, the first time
            assert (counts.dropped_duplicate, counts.consumed) == (0, 2)
        assert (await queue.stream_lengths())["groups"] == 0
        await again.admit()
        await roll_out(queue, version=again.trainer.version)
        record = await again.training_step()
        assert record is not None and record["step"] == 1 + int(checkpointed) + int(
            not checkpointed
        )
    finally:
        await again.aclose()


async def test_an_untrainable_group_is_dead_lettered_at_once(
    redis_url: str, keys: Keys, tmp_path: Path, tiny_model_dir: Path, queue: RedisQueue
) -> None:
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir, batch_groups=1)
    loop = await LearnerLoop.open(settings, queue)
    try:
        bad = make_group(Task(group_id="bad", questions=["q?"], answers=[["a"]], n=2))
        first = bad.trajectories[0].rounds[0]
        first.prompt_ids = type(first.prompt_ids)([100_000] * 4)  # outside the vocabulary
        await queue.publish_group(bad)
        await queue.publish_group(
            make_group(Task(group_id="good", questions=["q?"], answers=[["a"]], n=2))
        )
        record = await loop.training_step()
        assert record is not None and loop.trainer.step == 1
        (dead,) = await queue.dead_letters()
        assert "untrainable group" in dead["reason"] and "vocabulary" in dead["reason"]
        assert json.loads(dead["data"])["group_id"] == "bad"
    finally:
        await loop.aclose()


def empty_responses(group_id: str) -> Group:
    """A wire-valid group whose every response is empty (nothing to train on)."""
    data = make_group(Task(group_id=group_id, questions=["q?"], answers=[["a"]], n=2)).model_dump()
    for traj in data["trajectories"]:
        traj["p_mem"], traj["p_full"] = [], []
        for rnd in traj["rounds"]:
            rnd.update(response_ids=[], response_logprobs=[], mem_span=None)
    return Group.model_validate(data)


async def test_groups_without_a_response_token_are_dead_lettered_and_training_goes_on(
    redis_url: str, keys: Keys, tmp_path: Path, tiny_model_dir: Path, queue: RedisQueue
) -> None:
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir, batch_groups=1)
    loop = await LearnerLoop.open(settings, queue)
    try:
        for name in ("empty-1", "empty-2"):
            await queue.publish_group(empty_responses(name))
        await queue.publish_group(
            make_group(Task(group_id="good", questions=["q?"], answers=[["a"]], n=2))
        )
        record = await loop.training_step()
        assert record is not None and loop.trainer.step == 1
        dead = await queue.dead_letters()
        assert [json.loads(d["data"])["group_id"] for d in dead] == ["empty-1", "empty-2"]
        assert all("no response token" in d["reason"] for d in dead)
    finally:
        await loop.aclose()


async def test_a_nan_reward_never_reaches_the_published_policy(
    redis_url: str, keys: Keys, tmp_path: Path, tiny_model_dir: Path, queue: RedisQueue
) -> None:
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir, batch_groups=1)
    loop = await LearnerLoop.open(settings, queue)
    try:
        bad = make_group(Task(group_id="bad", questions=["q?"], answers=[["a"]], n=2))
        data = bad.model_dump(mode="json")
        data["trajectories"][0]["reward"] = "@"
        await queue.redis.xadd(keys.groups, {"data": json.dumps(data).replace('"@"', "NaN")})
        await queue.publish_group(
            make_group(Task(group_id="good", questions=["q?"], answers=[["a"]], n=2))
        )
        record = await loop.training_step()
        assert record is not None and record["skipped_steps"] == 0
        (dead,) = await queue.dead_letters()
        assert "reward" in dead["reason"] and json.loads(dead["data"])["group_id"] == "bad"
        published = map_safetensors(Path(loop.last_publish.path))  # type: ignore[union-attr]
        assert non_finite(published) is None
        assert non_finite(parameters(loop)) is None
    finally:
        await loop.aclose()


async def test_stale_groups_never_reach_the_trainer(
    redis_url: str, keys: Keys, tmp_path: Path, tiny_model_dir: Path, queue: RedisQueue
) -> None:
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir, max_staleness=0)
    loop = await LearnerLoop.open(settings, queue)
    try:
        await loop.admit()
        await roll_out(queue, version=0)
        assert await loop.training_step() is not None  # now at version 1
        await roll_out(queue, version=0)  # an engine that missed the update
        assert await loop.training_step() is None
        counts = await loop.state.counts()
        assert (counts.dropped_stale, counts.consumed, loop.trainer.step) == (2, 2, 1)
        await loop.admit()  # the dropped ones freed their places
        assert await roll_out(queue, version=1) == 2
        assert await loop.training_step() is not None
    finally:
        await loop.aclose()
