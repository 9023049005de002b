"""The trainer's state on the tiny model (services/learner/trainer.py): its learning-rate
schedule, its config's checks, and a reference model that owns its weights. The step itself
is tested in test_step.py."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from services.learner.trainer import Trainer, lr_factor
from services.learner.trainer_config import TrainerConfig
from tests.services.learner.test_step import snapshot


def test_lr_is_constant_after_the_warmup_or_decays_over_decay_steps_train_steps() -> None:
    constant = lr_factor(TrainerConfig(warmup_steps=2))
    assert [constant(s) for s in (0, 1, 2, 500)] == [0.5, 1.0, 1.0, 1.0]
    # 10 train steps x 2 epochs x 2 mini-batches = 40 optimizer steps of warmup then cosine.
    decay = lr_factor(TrainerConfig(warmup_steps=2, decay_steps=10, ppo_epochs=2, mini_batches=2))
    values = [decay(s) for s in range(60)]
    assert values[:2] == [0.5, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(values[1:]))
    assert values[20] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 18 / 37)))
    assert values[39] == pytest.approx(0.1) and values[59] == pytest.approx(0.1)


def test_span_mean_needs_token_mean() -> None:
    with pytest.raises(ValueError, match="span-mean needs loss_agg token-mean"):
        TrainerConfig(mem_loss="span-mean", loss_agg="seq-mean-token-mean")


def test_the_reference_model_is_not_a_view_of_the_base_model_s_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A rewrite of the base checkpoint in place (an `rsync --inplace`) once changed the KL
    reference under a running learner: the file was mapped and the tensors viewed it."""
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "m")  # never the shared fixture's files
    trainer = Trainer(TrainerConfig(beta_kl=0.01), tmp_path / "m")
    assert trainer.ref is not None
    before = snapshot(trainer.ref)
    file = tmp_path / "m" / "model.safetensors"
    with file.open("r+b") as handle:
        handle.seek(8)
        handle.write(b"\xff" * (file.stat().st_size - 8))
    assert all(torch.equal(p, before[n]) for n, p in trainer.ref.named_parameters())
