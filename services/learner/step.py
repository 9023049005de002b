"""One MemPO training step, top to bottom (docs/architecture.md lists it the same way).

    1. batch      groups -> one sequence per round, per-token advantages
                  (A_T, plus alpha * A_M on the round's <mem> tokens)
    2. log-probs  old (the rollout's, or recomputed with these weights) and reference,
                  both before any update
    3. update     ppo_epochs x shuffled mini-batches; in each, every micro-batch of this
                  rank: forward -> clipped surrogate + beta * KL - entropy bonus -> backward
    4. optimizer  one step per mini-batch: grad-norm clip, AdamW + warmup; skipped when
                  the loss or the norm is not finite (a bad number never reaches the weights)
    5. metrics    named sums, reduced over ranks once per mini-batch; the step's figures

The pure algorithm is mempo/advantages.py and mempo/losses.py (parity-tested); the batch
is services/learner/batch.py, micro-batches services/learner/packing.py, the loss of one
micro-batch services/learner/ppo.py. Under torchrun every rank runs this function on
the same groups (rank 0 sends them, services/learner/distributed.py): the other ranks
wait in ``follow``, which runs rank 0's train, save, export and restore commands.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mempo.schemas import Group
from services.learner import distributed
from services.learner.batch import TrainingBatch, build_batch, validate_group
from services.learner.checkpoint import export_trainer, restore_trainer, save_trainer
from services.learner.distributed import all_reduce_sum, lead, reduce_sums
from services.learner.packing import forward_logprobs, rank_micro_batches
from services.learner.ppo import (
    STATS,
    TOKEN_MEANS,
    TokenData,
    loss_weights,
    micro_loss,
    shuffled_minibatches,
)
from services.learner.trainer_config import TrainerConfig

if TYPE_CHECKING:
    from services.learner.trainer import Trainer

log = logging.getLogger(__name__)


def train_step(trainer: Trainer, groups: list[Group]) -> dict[str, float]:
    """One PPO update of ``trainer``'s policy on ``groups``: the step's metrics.

    Raises ValueError, before any rank starts, for a group the model cannot train on.
    """
    started = time.perf_counter()
    cfg, dist = trainer.config, trainer.dist
    # 1. the batch: sequences and per-token advantages
    batch = make_batch(groups, cfg, trainer.vocab_size)
    lead(dist, "train", groups)  # the other ranks build the same batch
    # 2. old and reference log-probs. A step of one update needs no old pass: its own
    #    forward is the old policy (ratio exactly 1).
    one_update = cfg.ppo_epochs * cfg.mini_batches == 1
    recomputed = (
        logprobs(trainer, trainer.policy, batch)
        if cfg.recompute_old_logprobs and not one_update
        else None
    )
    old = recomputed if cfg.recompute_old_logprobs else batch.rollout_logprobs
    ref = logprobs(trainer, trainer.ref, batch) if trainer.ref is not None else None
    logprob_s = time.perf_counter() - started
    tokens = TokenData.of(batch, old, ref, dist.device)
    # 3-4. ppo_epochs x mini-batches, one optimizer step each
    minibatches: list[dict[str, float]] = []
    first: tuple[list[int], Tensor] | None = None  # the first mini-batch and its log-probs
    for epoch in range(cfg.ppo_epochs):
        for mini in shuffled_minibatches(
            len(batch.sequences), cfg.mini_batches, cfg.seed, trainer.step, epoch
        ):
            metrics, seen = update(trainer, batch, mini, tokens)
            minibatches.append(metrics)
            first = first or (mini, seen)
    trainer.step += 1
    trainer.version += 1
    trainer.minibatch_metrics = minibatches
    # 5. metrics. The rollout/trainer log-prob gap: over the batch when recomputed, else
    #    on the first mini-batch's forward (taken before any update).
    if recomputed is not None:
        gap = (recomputed - batch.rollout_logprobs).abs()
    else:
        assert first is not None
        index = batch.token_index(first[0])
        seen = all_reduce_sum(first[1].cpu(), dist)  # each rank saw its share of the tokens
        gap = (seen[index] - batch.rollout_logprobs[index]).abs()
    return step_metrics(trainer, batch, minibatches, gap, logprob_s, time.perf_counter() - started)


def make_batch(groups: list[Group], cfg: TrainerConfig, vocab_size: int) -> TrainingBatch:
    """The batch of ``groups`` with its per-token advantages; ValueError names a group the
    model cannot train on (a token id outside the vocabulary)."""
    for group in groups:
        if reason := validate_group(group, vocab_size):
            raise ValueError(f"group {group.group_id}: {reason}")
    return build_batch(
        groups,
        cfg.alpha,
        cfg.eps,
        cfg.norm_by_std,
        cfg.mem_min_std,
        neg_adv_scale=cfg.neg_adv_scale,
        mem_baseline=cfg.mem_baseline,
        mem_gate=cfg.mem_gate,
        mem_norm=cfg.mem_norm,
    )


def update(
    trainer: Trainer, batch: TrainingBatch, mini: list[int], tokens: TokenData
) -> tuple[dict[str, float], Tensor]:
    """One optimizer step on mini-batch ``mini``, gradients accumulated over this rank's
    micro-batches: its metrics, and the log-probs this rank's forward saw (K,)."""
    cfg, dist = trainer.config, trainer.dist
    weights = loss_weights(batch, mini, cfg.loss_agg, cfg.mem_loss).to(dist.device)
    seen = torch.zeros(batch.num_tokens, device=dist.device)
    sums = {name: torch.zeros((), dtype=torch.float64, device=dist.device) for name in STATS}
    trainer.optimizer.zero_grad(set_to_none=True)
    for micro in rank_micro_batches(batch, mini, cfg, dist, trainer.pad_id):
        micro = micro.to(dist.device)
        with autocast(trainer):
            logp, logits = forward_logprobs(trainer.policy, micro)
        if micro.dummy:  # keeps the ranks' collectives in step on a rank without work
            (logits.sum() * 0.0).backward()
            continue
        loss, stats = micro_loss(cfg, micro, logp, logits, tokens, weights)
        (loss * dist.world_size).backward()  # FSDP2 averages gradients over ranks
        seen[micro.token_index] = logp.detach()
        for name, value in stats.items():
            sums[name] += value
    lr = float(trainer.optimizer.param_groups[0]["lr"])
    total = reduce_sums(sums, dist)  # before the step: every rank sees the loss
    grad_norm, stepped = optimizer_step(trainer, total["loss"])
    count = max(total["tokens"], 1.0)
    metrics = {name: total[name] / count for name in TOKEN_MEANS}
    metrics.update(tokens=total["tokens"], loss=total["loss"], grad_norm=grad_norm, lr=lr)
    metrics["skipped"] = 0.0 if stepped else 1.0
    return metrics, seen


def optimizer_step(trainer: Trainer, loss: float) -> tuple[float, bool]:
    """Clip and step: (gradient norm, whether the step was taken). A non-finite loss or
    norm (the same on every rank: both are reduced) skips the step with the gradients
    zeroed, so NaN / inf never reaches the weights or AdamW's moments."""
    norm = torch.nn.utils.clip_grad_norm_(trainer.policy.parameters(), trainer.config.grad_clip)
    full = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not (math.isfinite(loss) and math.isfinite(full)):
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.skipped_steps += 1
        log.warning(
            "step %d: optimizer step skipped (loss %s, gradient norm %s: not finite); %d skipped so far",
            trainer.step + 1, loss, full, trainer.skipped_steps,
        )  # fmt: skip
        return full, False
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.optimizer_steps += 1
    return full, True


@torch.no_grad()
def logprobs(trainer: Trainer, model: nn.Module, batch: TrainingBatch) -> Tensor:
    """Log-probs of every trained token under ``model``, in eval mode: (K,)."""
    was_training = model.training
    model.eval()
    out = torch.zeros(batch.num_tokens)
    every = list(range(len(batch.sequences)))
    for micro in rank_micro_batches(batch, every, trainer.config, trainer.dist, trainer.pad_id):
        with autocast(trainer):
            logp, _ = forward_logprobs(model, micro.to(trainer.dist.device))
        if not micro.dummy:
            out[micro.token_index] = logp.float().cpu()
    model.train(was_training)
    return all_reduce_sum(out, trainer.dist)


def autocast(trainer: Trainer) -> contextlib.AbstractContextManager[Any]:
    if trainer.config.dtype == "float32" or trainer.dist.sharded:  # FSDP2 casts by its policy
        return contextlib.nullcontext()
    return torch.autocast(trainer.dist.device.type, dtype=getattr(torch, trainer.config.dtype))


def step_metrics(
    trainer: Trainer,
    batch: TrainingBatch,
    minibatches: list[dict[str, float]],
    gap: Tensor,
    logprob_s: float,
    elapsed: float,
) -> dict[str, float]:
    """The batch's figures (rewards, advantages, memory), then the update's: token-weighted
    means over the mini-batches, loss and gradient norm, timings."""
    tokens = sum(m["tokens"] for m in minibatches) or 1.0
    metrics = dict(batch.stats)
    for name in TOKEN_MEANS:
        metrics[name] = sum(m[name] * m["tokens"] for m in minibatches) / tokens
    norms = [m["grad_norm"] for m in minibatches]
    metrics.update(
        loss=sum(m["loss"] for m in minibatches) / len(minibatches),
        grad_norm=sum(norms) / len(norms),
        grad_norm_max=max(norms),
        lr=minibatches[-1]["lr"],
        logprob_gap=float(gap.mean()) if gap.numel() else 0.0,
        logprob_gap_max=float(gap.max()) if gap.numel() else 0.0,
        optimizer_steps=float(sum(1 for m in minibatches if not m["skipped"])),
        skipped_steps=float(sum(m["skipped"] for m in minibatches)),
        step=float(trainer.step),
        version=float(trainer.version),
        step_time_s=elapsed,
        tokens_per_s=batch.stats["tokens_total"] / max(elapsed, 1e-9),
        logprob_time_s=logprob_s,
    )
    return metrics


def follow(trainer: Trainer) -> None:
    """Ranks > 0: run rank 0's train, save, export and restore commands until it closes."""
    distributed.follow(
        trainer.dist,
        {
            "train": lambda groups: train_step(trainer, groups),
            "save": lambda args: save_trainer(trainer, Path(args[0]), args[1], args[2]),
            "export": lambda out: export_trainer(trainer, Path(out)),
            "restore": lambda root: restore_trainer(trainer, Path(root)),
        },
    )
