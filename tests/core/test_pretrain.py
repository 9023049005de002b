"""LM pretraining of the tiny model: the schedule, the corpus, and that the loss falls."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from mempo.pretrain import FIRST_WORLD, cosine_schedule, pretrain, pretraining_texts


def test_cosine_schedule_warms_up_then_decays_to_the_final_ratio() -> None:
    factor = cosine_schedule(warmup_steps=4, steps=20, final_ratio=0.1)
    values = [factor(step) for step in range(20)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(values[3:]))
    assert values[-1] == pytest.approx(0.1)
    assert cosine_schedule(0, 10, 1.0)(5) == 1.0


def test_pretraining_texts_come_from_other_worlds(world: Any) -> None:
    texts = pretraining_texts(worlds=1, results_per_world=20)
    assert any(t.startswith("Doc 1(Title: ") for t in texts)
    joined = "\n".join(texts)
    facts = [p["contents"].split("\n", 1)[1].split(".")[0] for p in world.passages]
    assert not any(fact in joined for fact in facts)  # nothing of the agent's world
    assert world.config.seed != FIRST_WORLD


def test_pretraining_lowers_the_loss(tiny_model_dir: Any, tokenizer: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    losses = pretrain(model, tokenizer, pretraining_texts(1, 60), steps=30, batch_size=8, length=128)
    assert len(losses) == 30 and sum(losses[-5:]) < 0.8 * sum(losses[:5])
    with pytest.raises(ValueError, match="fewer than"):
        pretrain(model, tokenizer, ["short"], steps=1)
