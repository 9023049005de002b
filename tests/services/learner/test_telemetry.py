"""The learner's step log on the real loop and tiny model: every step's figures reach
metrics.jsonl (today's names) and TensorBoard (the trackers' names), and every
``sample_every`` steps the step's trajectories are decoded to samples/step-<n>.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mempo.keys import Keys
from mempo.queue import RedisQueue
from services.learner.loop import LearnerLoop
from tests.services.learner.service_support import StandInEngine
from tests.services.learner.test_service_loop import learner_settings, roll_out

pytest.importorskip("tensorboard")


async def test_two_steps_reach_the_journal_tensorboard_and_the_samples(
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    queue: RedisQueue,
    fleet: list[StandInEngine],
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = learner_settings(
        redis_url, keys, tmp_path, tiny_model_dir, tracking="tensorboard", sample_every=2, sample_trajectories=3
    )
    loop = await LearnerLoop.open(settings, queue)
    try:
        for version in (0, 1):
            await loop.admit()
            await roll_out(queue, version=version)
            assert await loop.training_step() is not None
    finally:
        await loop.aclose()
    run = settings.run_dir
    journal = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in journal] == [1, 2] and "pg_loss" in journal[0]
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for tag in ("actor/pg_loss", "critic/score/mean", "rollout/policy_version", "timing_s/step", "perf/throughput"):
        assert tag in tags and [e.step for e in events.Scalars(tag)] == [1, 2], tag
    assert [e.value for e in events.Scalars("critic/score/mean")] == pytest.approx([r["reward_mean"] for r in journal])
    assert "samples/text_summary" in events.Tags()["tensors"]  # the decoded trajectories as text
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step-2.jsonl"]
    rows = [json.loads(line) for line in (run / "samples" / "step-2.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(row["rounds"] and row["questions"] for row in rows)
    first = rows[0]["rounds"][0]
    assert set(first) >= {"memory", "think", "query", "information", "answer", "p_mem", "p_full"}
