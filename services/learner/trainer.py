"""The trainer's state: the policy, its frozen reference, AdamW and the LR schedule,
the step counters. What acts on it imports it, never the other way: the training step
and a follower rank's ``follow`` are services/learner/step.py; checkpoints (save, load,
resume, restore) and exports are services/learner/checkpoint.py. Under torchrun those
functions send their command to the other ranks (services/learner/distributed.py).

The policy and the reference (the initial policy) live on the same device; master
weights are float32.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mempo.model_weights import own_tensors
from mempo.schedule import cosine_schedule
from services.learner.distributed import DistContext, init_distributed, release, shard_model
from services.learner.trainer_config import TrainerConfig


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_model(
    path: str | Path, config: TrainerConfig, ctx: DistContext, trainable: bool
) -> nn.Module:
    """An HF causal LM in float32 on ``ctx.device``; frozen unless ``trainable``."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=config.attn_implementation
    )
    model.config.use_cache = False
    model.to(ctx.device)
    own_tensors(model)  # on CPU: not a view of the base model's file (the KL reference for the run)
    if trainable:
        model.train()
        if config.gradient_checkpointing:  # transformers 5.24 renamed it
            enable = getattr(model, "activation_checkpointing_enable", None)
            (enable or model.gradient_checkpointing_enable)()
    else:
        model.eval()
        model.requires_grad_(False)
    if ctx.sharded:
        shard_model(model, ctx, getattr(torch, config.dtype))
    return model  # type: ignore[no-any-return]


def lr_factor(config: TrainerConfig) -> Callable[[int], float]:
    """LR multiplier per optimizer step: the warmup, then constant or (``decay_steps``) a
    cosine to ``final_lr_ratio`` over that many train steps' optimizer steps."""
    per_step = config.ppo_epochs * config.mini_batches
    if not config.decay_steps:
        return cosine_schedule(config.warmup_steps, 1, 1.0)
    return cosine_schedule(config.warmup_steps, config.decay_steps * per_step, config.final_lr_ratio)


class Trainer:
    """PPO's state for the policy at ``model_path``; ``version`` counts the train steps taken."""

    def __init__(self, config: TrainerConfig, model_path: str | Path, device: str = "cpu") -> None:
        self.config = config
        self.model_path = Path(model_path)
        self.dist = init_distributed(device)
        seed_everything(config.seed)
        self.policy = load_model(model_path, config, self.dist, trainable=True)
        self.ref = (
            load_model(model_path, config, self.dist, trainable=False)
            if config.beta_kl > 0
            else None
        )
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(),
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_factor(config)
        )
        self._initial_schedule = self.scheduler.state_dict()
        self._initial_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.step = 0
        self.version = 0
        self.optimizer_steps = 0
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss or gradient
        hf_config: Any = self.policy.config
        self.vocab_size = int(hf_config.vocab_size)
        self.max_positions = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or None
        self.pad_id = int(hf_config.pad_token_id if hf_config.pad_token_id is not None else 0)
        self.minibatch_metrics: list[dict[str, float]] = []  # of the last step, in order

    def reset(self) -> None:
        """Back to the initial state (before any checkpoint): the policy at ``model_path``,
        no AdamW moments, the schedule's start, no optimizer step, the seeded RNGs."""
        initial = load_model(self.model_path, self.config, self.dist, trainable=True)
        self.policy.load_state_dict(initial.state_dict())
        self.optimizer.state.clear()
        self.scheduler.load_state_dict(self._initial_schedule)
        for group, lr in zip(self.optimizer.param_groups, self._initial_lrs, strict=True):
            group["lr"] = lr
        self.optimizer_steps = self.skipped_steps = 0
        seed_everything(self.config.seed)

    def close(self) -> None:
        """Rank 0: release the followers; every rank: leave the process group."""
        release(self.dist)
