"""The PPO trainer: one ``train_step`` per policy version, read top to bottom.

    groups -> batch + per-token advantages -> old log-probs -> reference log-probs
           -> ppo_epochs x shuffled mini-batches (micro-batch gradient accumulation)
           -> clipped surrogate + beta * KL - entropy bonus, agg_loss over the mini-batch
           -> grad-norm clip -> AdamW + warmup schedule (skipped when the loss or the
              gradient norm is not finite: one bad number never reaches the weights)

The trainer knows the algorithm only through per-token advantages (services/learner/
batch.py computes them from mempo.advantages). The policy and a frozen reference copy of
the initial policy live on the same device; master weights are float32.

Under torchrun, rank 0 calls these methods and the other ranks sit in ``follow()``;
every collective method broadcasts its command first (services/learner/distributed.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from mempo.schemas import Group
from services.learner import checkpoint
from services.learner.batch import TrainingBatch, build_batch, validate_group
from services.learner.checkpoint import CheckpointState, TrainingState
from services.learner.distributed import (
    DistContext,
    all_reduce_max,
    all_reduce_sum,
    broadcast_object,
    full_model_state,
    full_optimizer_state,
    init_distributed,
    load_full_state,
    shard_model,
    split_across_ranks,
)
from services.learner.packing import MicroBatch, dummy_micro_batch, forward_logprobs, micro_batches
from services.learner.ppo import SUMS, TokenData, loss_denominator, micro_loss, shuffled_minibatches
from services.learner.trainer_config import TrainerConfig

log = logging.getLogger(__name__)


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


def warmup_factor(warmup_steps: int) -> Any:
    """LR multiplier: linear from 1 / warmup_steps up to 1, then constant."""
    return lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


class Trainer:
    """PPO on the policy at ``model_path``; ``version`` counts the train steps taken."""

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
            self.optimizer, warmup_factor(config.warmup_steps)
        )
        self.step = 0
        self.version = 0
        self.optimizer_steps = 0
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite loss or gradient
        hf_config: Any = self.policy.config
        self.vocab_size = int(hf_config.vocab_size)
        self.pad_id = int(hf_config.pad_token_id if hf_config.pad_token_id is not None else 0)
        self.minibatch_metrics: list[dict[str, float]] = []  # of the last step, in order
        self._first_logp = torch.zeros(0)  # trainer log-probs seen by the first mini-batch
        self._first_mini: list[int] = []

    # ----------------------------------------------------------------- the step

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One PPO update on ``groups``; returns the step's metrics (rank 0's call).

        Raises ValueError (before any rank starts) for a group the model cannot train on.
        """
        started = time.perf_counter()
        batch = self._batch(groups)
        self._lead("train", [g.model_dump_json(context={"pack": True}) for g in groups])
        return self._train(batch, started)

    def _batch(self, groups: list[Group]) -> TrainingBatch:
        """Sequences and per-token advantages (A_T + alpha * A_M on <mem> tokens)."""
        for group in groups:
            if reason := validate_group(group, self.vocab_size):
                raise ValueError(f"group {group.group_id}: {reason}")
        c = self.config
        return build_batch(
            groups, c.alpha, c.eps, c.norm_by_std, c.mem_min_std, neg_adv_scale=c.neg_adv_scale
        )

    def _train(self, batch: TrainingBatch, started: float) -> dict[str, float]:
        cfg = self.config
        # Old log-probs: recomputed with our weights; with a single update per step, the
        # update's own forward (ratio exactly 1, one pass saved); or the rollout's.
        single_update = cfg.ppo_epochs * cfg.mini_batches == 1
        recompute = cfg.recompute_old_logprobs and not single_update
        trainer_logp = self._logprobs(self.policy, batch) if recompute else None
        old_logp = trainer_logp if cfg.recompute_old_logprobs else batch.rollout_logprobs
        ref_logp = self._logprobs(self.ref, batch) if self.ref is not None else None
        scored_s = time.perf_counter() - started
        tokens = TokenData.of(batch, old_logp, ref_logp, self.dist.device)
        self.minibatch_metrics = []
        for epoch in range(cfg.ppo_epochs):
            order = shuffled_minibatches(
                len(batch.sequences), cfg.mini_batches, cfg.seed, self.step, epoch
            )
            for mini in order:
                self.minibatch_metrics.append(self._update(batch, mini, tokens))
        self.step += 1
        self.version += 1
        # the rollout/trainer gap: over the batch when recomputed, else on the first
        # mini-batch's forward (taken before any update)
        if trainer_logp is not None:
            gap = trainer_logp - batch.rollout_logprobs
        else:
            first = batch.token_index(self._first_mini)
            gap = self._first_logp[first] - batch.rollout_logprobs[first]
        metrics = self._step_metrics(batch, gap.abs(), time.perf_counter() - started)
        metrics["logprob_time_s"] = scored_s
        return metrics

    def _update(self, batch: TrainingBatch, mini: list[int], tokens: TokenData) -> dict[str, float]:
        """Accumulate gradients over this rank's micro-batches of ``mini``; one optimizer step."""
        first = not self.minibatch_metrics
        denominator, token_scale = loss_denominator(
            batch, mini, self.config.loss_agg, self.config.mem_loss
        )
        scale = token_scale.to(self.dist.device) if token_scale is not None else None
        logp_seen = torch.zeros(batch.num_tokens, device=self.dist.device)
        sums = torch.zeros(len(SUMS), dtype=torch.float64, device=self.dist.device)
        self.optimizer.zero_grad(set_to_none=True)
        for micro in self._my_micro_batches(batch, mini):
            micro = micro.to(self.dist.device)
            with self._autocast():
                logp, logits = forward_logprobs(self.policy, micro)
            if micro.dummy:  # keeps the ranks' collectives in step on a rank without work
                (logits.sum() * 0.0).backward()
                continue
            loss, stats = micro_loss(self.config, micro, logp, logits, tokens, denominator, scale)
            (loss * self.dist.world_size).backward()  # FSDP2 averages gradients over ranks
            logp_seen[micro.token_index] = logp.detach()
            sums += stats
        lr = float(self.optimizer.param_groups[0]["lr"])
        sums = all_reduce_sum(sums.cpu(), self.dist)  # before the step: every rank sees the loss
        grad_norm, stepped = self._optimizer_step(float(sums[-1]))
        if first:
            self._first_logp = all_reduce_sum(logp_seen.cpu(), self.dist)
            self._first_mini = mini
        count = max(float(sums[0]), 1.0)
        metrics = {name: float(sums[i]) / count for i, name in enumerate(SUMS)}
        metrics.update(tokens=float(sums[0]), loss=float(sums[-1]), grad_norm=grad_norm, lr=lr)
        metrics["skipped"] = 0.0 if stepped else 1.0
        return metrics

    def _optimizer_step(self, loss: float) -> tuple[float, bool]:
        """Clip and step: (gradient norm, whether the step was taken). A non-finite loss or
        norm (the same on every rank: both are reduced) skips the step with the gradients
        zeroed, so NaN / inf never reaches the weights or AdamW's moments."""
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.grad_clip)
        full = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not (math.isfinite(loss) and math.isfinite(full)):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            log.warning(
                "step %d: optimizer step skipped (loss %s, gradient norm %s: not finite); "
                "%d skipped so far",
                self.step + 1,
                loss,
                full,
                self.skipped_steps,
            )
            return full, False
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        return full, True

    # ----------------------------------------------------------------- forwards

    def _my_micro_batches(self, batch: TrainingBatch, seqs: list[int]) -> list[MicroBatch]:
        """This rank's share of ``seqs``, packed; padded with dummies to the ranks' max count."""
        lengths = [len(s.input_ids) for s in batch.sequences]
        share = split_across_ranks(seqs, lengths, self.dist.world_size)[self.dist.rank]
        cfg = self.config
        mine = micro_batches(
            batch, share, cfg.micro_batch_tokens, cfg.row_tokens, cfg.packing, self.pad_id
        )
        count = all_reduce_max(len(mine), self.dist)
        return mine + [dummy_micro_batch(self.pad_id)] * (count - len(mine))

    @torch.no_grad()
    def _logprobs(self, model: nn.Module, batch: TrainingBatch) -> Tensor:
        """Log-probs of every trained token under ``model``, in eval mode: (K,)."""
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.num_tokens)
        for micro in self._my_micro_batches(batch, list(range(len(batch.sequences)))):
            with self._autocast():
                logp, _ = forward_logprobs(model, micro.to(self.dist.device))
            if not micro.dummy:
                out[micro.token_index] = logp.float().cpu()
        model.train(was_training)
        return all_reduce_sum(out, self.dist)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.dtype == "float32" or self.dist.sharded:  # FSDP2 casts by its policy
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=getattr(torch, self.config.dtype))

    # ----------------------------------------------------------------- metrics

    def _step_metrics(self, batch: TrainingBatch, gap: Tensor, elapsed: float) -> dict[str, float]:
        mb = self.minibatch_metrics
        tokens = sum(m["tokens"] for m in mb) or 1.0
        metrics = dict(batch.stats)
        for name in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl", "entropy"):
            metrics[name] = sum(m[name] * m["tokens"] for m in mb) / tokens
        metrics.update(
            loss=float(np.mean([m["loss"] for m in mb])),
            grad_norm=float(np.mean([m["grad_norm"] for m in mb])),
            grad_norm_max=float(max(m["grad_norm"] for m in mb)),
            lr=mb[-1]["lr"],
            logprob_gap=float(gap.mean()) if gap.numel() else 0.0,
            logprob_gap_max=float(gap.max()) if gap.numel() else 0.0,
            optimizer_steps=float(sum(1 for m in mb if not m["skipped"])),
            skipped_steps=float(sum(m["skipped"] for m in mb)),
            step=float(self.step),
            version=float(self.version),
            step_time_s=elapsed,
            tokens_per_s=batch.stats["tokens_total"] / max(elapsed, 1e-9),
        )
        return metrics

    # ----------------------------------------------------------------- checkpoints

    def save_checkpoint(
        self, root: Path, trained_group_ids: list[str], extra: dict[str, Any] | None = None
    ) -> Path:
        """Atomic checkpoint of everything needed to resume (collective under torchrun)."""
        self._lead("save", (str(root), list(trained_group_ids), dict(extra or {})))
        return self._save(Path(root), trained_group_ids, extra or {})

    def _save(self, root: Path, trained_group_ids: list[str], extra: dict[str, Any]) -> Path:
        model_state = full_model_state(self.policy, self.dist)
        optimizer_state = full_optimizer_state(self.policy, self.optimizer, self.dist)
        path = root / f"step-{self.step:08d}"
        if self.dist.is_main:
            state = TrainingState(
                meta=CheckpointState(self.step, self.version, list(trained_group_ids), extra),
                model=model_state,
                optimizer=optimizer_state,
                scheduler={**self.scheduler.state_dict(), "optimizer_steps": self.optimizer_steps},
                rng=checkpoint.capture_rng(),
            )
            path = checkpoint.save(root, state, self.config.keep_last)
        if self.dist.sharded:
            torch.distributed.barrier()
        return path

    def load_checkpoint(self, path: Path) -> CheckpointState:
        """Restore weights, optimizer, schedule, RNG and counters from ``path`` (every rank)."""
        state = checkpoint.load(path)
        load_full_state(self.policy, self.optimizer, state.model, state.optimizer)
        scheduler = dict(state.scheduler)
        self.optimizer_steps = int(scheduler.pop("optimizer_steps", 0))
        self.scheduler.load_state_dict(scheduler)
        checkpoint.restore_rng(state.rng)
        self.step, self.version = state.meta.step, state.meta.version
        log.info("resumed from %s (step %s, version %s)", path, self.step, self.version)
        return state.meta

    @classmethod
    def resume(
        cls, config: TrainerConfig, model_path: str | Path, root: Path, device: str = "cpu"
    ) -> tuple[Trainer, CheckpointState | None]:
        """A trainer continued from the latest checkpoint under ``root``, if there is one.

        The reference model stays the initial policy at ``model_path``.
        """
        trainer = cls(config, model_path, device)
        path = checkpoint.latest(Path(root))
        return trainer, (trainer.load_checkpoint(path) if path is not None else None)

    def export_hf(self, out_dir: Path) -> Path:
        """The current policy as an HF folder (safetensors, config, tokenizer files)."""
        self._lead("export", str(out_dir))
        return self._export(Path(out_dir))

    def _export(self, out_dir: Path) -> Path:
        state = full_model_state(self.policy, self.dist)
        if self.dist.is_main:
            tied = checkpoint.tied_parameter_names(self.policy)
            checkpoint.export_hf(state, self.policy.config, self.model_path, out_dir, self._export_dtype, tied)
        if self.dist.sharded:
            torch.distributed.barrier()
        return out_dir

    @property
    def _export_dtype(self) -> torch.dtype | None:
        return getattr(torch, self.config.export_dtype) if self.config.export_dtype else None

    def export_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors ``export_hf`` writes, in memory (a weight broadcast sends them).
        Unsharded trainers only: a sharded one exports through ``export_hf``."""
        if self.dist.sharded:
            raise RuntimeError("a sharded trainer publishes through export_hf (disk) only")
        state = full_model_state(self.policy, self.dist)
        tied = checkpoint.tied_parameter_names(self.policy)
        return checkpoint.export_tensors(state, self._export_dtype, tied)

    # ----------------------------------------------------------------- ranks

    def _lead(self, command: str, payload: Any) -> None:
        """Rank 0: send the command to the ranks in ``follow()``."""
        if self.dist.sharded:
            if not self.dist.is_main:
                raise RuntimeError("only rank 0 drives the trainer; other ranks run follow()")
            broadcast_object((command, payload), self.dist)

    def follow(self) -> None:
        """Ranks > 0: run rank 0's commands until it calls ``close()``."""
        while True:
            command, payload = broadcast_object(None, self.dist)
            if command == "train":
                groups = [Group.model_validate_json(g) for g in payload]
                self._train(self._batch(groups), time.perf_counter())
            elif command == "save":
                self._save(Path(payload[0]), payload[1], payload[2])
            elif command == "export":
                self._export(Path(payload))
            elif command == "stop":
                return

    def close(self) -> None:
        """Rank 0: release the followers; every rank: leave the process group."""
        if self.dist.sharded:
            if self.dist.is_main:
                broadcast_object(("stop", None), self.dist)
            torch.distributed.destroy_process_group()
