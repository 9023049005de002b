"""Reading-drill pretraining of the tiny model: the drills, and that the loss falls."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mempo_sim.pretrain import (
    FIRST_WORLD,
    answer_weights,
    drill_accuracy,
    drill_texts,
    pack_rows,
    pretrain,
    probe_drills,
)


def test_drills_come_from_other_worlds_and_hold_their_answers(world: Any) -> None:
    import re

    drills = drill_texts(worlds=2, drills_per_world=30)
    assert len(drills) > 40 and drills == drill_texts(worlds=2, drills_per_world=30)
    orders = {d.startswith("Question: ") for d in drills}
    assert orders == {True, False}  # both orders
    for drill in drills:
        documents = "\n".join(line for line in drill.splitlines() if line.startswith("Doc "))
        answers = re.findall(r"^Answer: (\w+)$", drill, re.M)
        assert answers and all(f" {a}" in documents for a in answers), drill
    facts = [p["contents"].split("\n", 1)[1].split(".")[0] for p in world.passages]
    joined = "\n".join(drills)
    assert not any(fact in joined for fact in facts)  # nothing of the agent's world
    assert world.config.seed != FIRST_WORLD


def test_pretraining_lowers_the_loss(tiny_model_dir: Any, tokenizer: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    losses = pretrain(model, tokenizer, drill_texts(1, 60), steps=30, batch_size=8, length=128)
    assert len(losses) == 30 and sum(losses[-5:]) < 0.8 * sum(losses[:5])
    drills = probe_drills(count=10)
    assert len(drills) == 10 and all(d.startswith("Question: ") for d in drills)
    assert 0.0 <= drill_accuracy(model, tokenizer, drills) <= 1.0
    with pytest.raises(ValueError, match="fits in"):
        pretrain(model, tokenizer, ["long " * 200], steps=1, length=64)


def test_answers_weigh_more() -> None:
    ids = torch.tensor([[5, 7, 8, 9, 7, 8, 3], [7, 8, 7, 8, 9, 9, 9]])  # 7 8 = "Answer" ":"
    expected = torch.tensor([[1, 1, 1, 10, 1, 1, 10], [1, 1, 10, 1, 10, 1, 1]], dtype=torch.float32)
    assert torch.equal(answer_weights(ids, answer=7, colon=8, weight=10.0), expected)


def test_rows_hold_whole_texts() -> None:
    texts = [[1] * 3, [2] * 5, [3] * 9, [4] * 2, [5] * 4]
    rows = pack_rows(texts, eos=0, length=8)
    assert rows == [[1, 1, 1, 0], [2, 2, 2, 2, 2, 0], [4, 4, 0, 5, 5, 5, 5, 0]]  # 9 + EOS > 8: left out
