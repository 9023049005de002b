"""mempo.schedule: the learning-rate factor every training loop uses (the learner, SFT, the
tiny model's pretraining)."""

from __future__ import annotations

import itertools

import pytest

from mempo.schedule import cosine_schedule


def test_cosine_schedule_warms_up_then_decays_to_the_final_ratio() -> None:
    factor = cosine_schedule(warmup_steps=4, steps=20, final_ratio=0.1)
    values = [factor(step) for step in range(20)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(values[3:]))
    assert values[-1] == pytest.approx(0.1)
    assert cosine_schedule(0, 10, 1.0)(5) == 1.0
