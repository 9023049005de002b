"""The learner loop when a step cannot train: a round over max_sequence_tokens, a batch
whose step raises (before or after an optimizer step, any number in a row): nothing stops
the learner, the trainer is put back as it was, the groups are dead-lettered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from mempo.keys import Keys
from mempo.queue import RedisQueue
from mempo.schemas import Group, Task
from services.learner import loop as learner_loop
from services.learner.loop import LearnerLoop
from services.learner.step import train_step
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from tests.services.learner.service_support import make_group
from tests.services.learner.test_service_loop import learner_settings, parameters


async def publish(queue: RedisQueue, group_id: str, n: int = 2, **group: Any) -> None:
    """A one-question group of ``n`` trajectories (make_group's options in ``group``)."""
    await queue.publish_group(make_group(Task(group_id=group_id, questions=["q?"], answers=[["a"]], n=n), **group))


@pytest.mark.parametrize("cap", [0, 100])
async def test_a_round_longer_than_max_sequence_tokens_is_dead_lettered_unseen_by_the_trainer(
    redis_url: str, keys: Keys, tmp_path: Path, tiny_model_dir: Path, queue: RedisQueue, cap: int
) -> None:
    """A group with a 16,000-id prompt once trained (1.46 GB, 25 s a step; memory grows
    with the square of the length). 0: the model's context (8192 for the tiny model)."""
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir, batch_groups=1, max_sequence_tokens=cap)
    loop = await LearnerLoop.open(settings, queue)
    try:
        long_prompt = 16_000 if cap == 0 else 90  # over the cap with its 16 response tokens
        await publish(queue, "long", prompt_len=long_prompt)
        await publish(queue, "fits", prompt_len=40)
        record = await loop.training_step()
        assert record is not None and loop.trainer.step == 1  # trained on "fits" only
        (dead,) = await queue.dead_letters()
        assert '"group_id":"long"' in dead["data"]  # (16,000 ids: kept as a 256 KiB preview)
        limit = 8192 if cap == 0 else cap
        assert f"{long_prompt + 16} tokens, over the learner's max_sequence_tokens of {limit}" in dead["reason"]
    finally:
        await loop.aclose()


async def test_a_batch_whose_training_raises_is_dead_lettered_and_training_goes_on(
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    queue: RedisQueue,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir, batch_groups=1)
    loop = await LearnerLoop.open(settings, queue)
    try:
        for group_id in ("bad", "good"):
            await publish(queue, group_id)

        def picky(trainer: Trainer, groups: list[Group]) -> dict[str, float]:
            if groups[0].group_id == "bad":
                raise OverflowError("value cannot be converted to type float without overflow")
            return train_step(trainer, groups)

        monkeypatch.setattr(learner_loop, "train_step", picky)
        record = await loop.training_step()
        assert record is not None and loop.trainer.step == 1  # trained on "good"
        (dead,) = await queue.dead_letters()
        assert json.loads(dead["data"])["group_id"] == "bad"
        assert "OverflowError: value cannot be converted" in dead["reason"]
        assert (await queue.stream_lengths())["groups"] == 0 and loop.failed_batches == 0
    finally:
        await loop.aclose()


async def test_any_number_of_failing_batches_in_a_row_are_dead_lettered_and_training_goes_on(
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    queue: RedisQueue,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three failed batches in a row once stopped the learner for good."""
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir, batch_groups=1)
    loop = await LearnerLoop.open(settings, queue)
    try:
        for group_id in [*(f"bad{i}" for i in range(5)), "good"]:
            await publish(queue, group_id)

        def explode(trainer: Trainer, groups: list[Group]) -> dict[str, float]:
            if groups[0].group_id.startswith("bad"):
                raise RuntimeError("CUDA error: an illegal memory access")
            return train_step(trainer, groups)

        monkeypatch.setattr(learner_loop, "train_step", explode)
        record = await loop.training_step()
        assert record is not None and loop.trainer.step == 1 and loop.failed_batches == 0
        dead = await queue.dead_letters()
        assert sorted(json.loads(d["data"])["group_id"] for d in dead) == [f"bad{i}" for i in range(5)]
        assert all("illegal memory access" in d["reason"] for d in dead)
        assert (await queue.stream_lengths())["groups"] == 0
    finally:
        await loop.aclose()


def optimizer_moments(loop: LearnerLoop) -> list[torch.Tensor]:
    state = loop.trainer.optimizer.state  # type: ignore[attr-defined]
    return [t.detach().clone() for s in state.values() for t in s.values() if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("trained_before", [0, 1])
async def test_a_step_that_fails_half_way_is_undone_and_training_goes_on(
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    queue: RedisQueue,
    monkeypatch: pytest.MonkeyPatch,
    trained_before: int,
) -> None:
    """The second mini-batch raises after the first one's optimizer step, with the settings
    that once made it stop the learner at every restart (no old log-prob pass, no KL): the
    weights, AdamW and the counters go back to the state before the step (its checkpoint,
    or the initial state), the group is dead-lettered, the next batch trains."""
    from services.learner import step as learner_step

    trainer = TrainerConfig(warmup_steps=0, mini_batches=2, lr=1e-2, recompute_old_logprobs=False, beta_kl=0.0)
    settings = learner_settings(redis_url, keys, tmp_path, tiny_model_dir, batch_groups=1, trainer=trainer)
    loop = await LearnerLoop.open(settings, queue)
    try:
        for group_id in [f"ok{i}" for i in range(trained_before)] + ["half", "after"]:
            if group_id == "half":  # on-policy for the version reached
                for _ in range(trained_before):
                    assert await loop.training_step() is not None
            await publish(queue, group_id, n=4, policy_version=loop.trainer.version)
        before = parameters(loop), optimizer_moments(loop), loop.trainer.optimizer_steps
        real_update, calls = learner_step.update, []

        def failing_update(trainer: Trainer, batch: Any, mini: Any, tokens: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("the second mini-batch failed")
            return real_update(trainer, batch, mini, tokens)

        monkeypatch.setattr(learner_step, "update", failing_update)
        batch = await loop.consumer.next_batch(loop.trainer.version, None)
        assert batch is not None and await loop._train(batch) is None
        assert loop.trainer.optimizer_steps == before[2] and loop.trainer.step == trained_before
        after = parameters(loop)
        assert all(torch.equal(after[k], v) for k, v in before[0].items())
        moments = optimizer_moments(loop)
        assert len(moments) == len(before[1]) and all(torch.equal(a, b) for a, b in zip(moments, before[1], strict=True))
        (dead,) = await queue.dead_letters()
        assert json.loads(dead["data"])["group_id"] == "half" and "second mini-batch" in dead["reason"]
        monkeypatch.setattr(learner_step, "update", real_update)
        assert await loop.training_step() is not None and loop.trainer.step == trained_before + 1
    finally:
        await loop.aclose()
