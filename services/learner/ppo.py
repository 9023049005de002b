"""The PPO update's pieces: mini-batch order, mini-batch loss weights, a micro-batch's loss.

A mini-batch is one optimizer step; its loss is split over micro-batches (and ranks)
whose losses add up to exactly the mini-batch loss: every micro-batch weighs its tokens
by the weights of the whole mini-batch (mempo.losses.agg_weights).

Glossary: K trained tokens (of the batch, or of one micro-batch), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mempo.losses import AggMode, agg_weights, entropy_from_logits, kl_penalty, ppo_policy_loss
from services.learner.batch import TrainingBatch
from services.learner.packing import MicroBatch
from services.learner.trainer_config import TrainerConfig

# What micro_loss reports, summed over a mini-batch's micro-batches and ranks: the
# trained tokens, per-token figures (divided by the tokens for the mean), the loss.
TOKEN_MEANS = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl", "entropy")
STATS = ("tokens", *TOKEN_MEANS, "loss")


@dataclass(frozen=True)
class TokenData:
    """The step's per-token inputs in trained-token space, on the training device: (K,)."""

    advantages: Tensor
    old: Tensor | None  # None: the update's own forward, detached (a single update per step)
    ref: Tensor | None

    @classmethod
    def of(
        cls, batch: TrainingBatch, old: Tensor | None, ref: Tensor | None, device: torch.device
    ) -> TokenData:
        return cls(
            advantages=batch.advantages.to(device),
            old=old.to(device) if old is not None else None,
            ref=ref.to(device) if ref is not None else None,
        )


def shuffled_minibatches(
    num_sequences: int, mini_batches: int, seed: int, step: int, epoch: int
) -> Iterator[list[int]]:
    """Sequence indices shuffled by (seed, step, epoch), split into near-equal parts.

    Seeded by the step, not by a running generator, so a resumed run shuffles exactly as
    an uninterrupted one, and every rank alike.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + epoch)
    order = torch.randperm(num_sequences, generator=generator).numpy()
    for part in np.array_split(order, mini_batches):
        if len(part):
            yield [int(i) for i in part]


def loss_weights(
    batch: TrainingBatch, mini: list[int], loss_agg: AggMode, mem_loss: str = "shared"
) -> Tensor:
    """The loss weight of every trained token (K,) for mini-batch ``mini``, 0 outside it.

    mempo.losses.agg_weights over the whole mini-batch, so the micro-batches' weighted
    sums add up to exactly agg_loss over the mini-batch, however its sequences (and a
    trajectory's rounds) fall into micro-batches and ranks. ``mem_loss`` "span-mean"
    (token-mean only): see span_mean_weights.
    """
    idx = batch.token_index(mini)
    if mem_loss == "span-mean":
        return span_mean_weights(batch, idx)
    mask = torch.zeros(batch.num_tokens)  # (K,)
    mask[idx] = 1.0
    return agg_weights(mask, loss_agg, seq_ids=batch.seq_ids, traj_ids=batch.traj_ids)


def span_mean_weights(batch: TrainingBatch, idx: Tensor) -> Tensor:
    """Per-token weights (K,) of FoldAct's separated loss (arXiv 2512.22733) over the
    trained tokens ``idx`` of a mini-batch: loss = token-mean over the tokens outside
    ``<mem>`` + mean over the ``<mem>`` spans of each span's own token-mean. A token outside
    weighs 1 / (tokens outside), a token of span s 1 / (spans x tokens of s), so a 20-token
    summary is not diluted by a token-mean over 400 tokens of thought and answer."""
    chosen = torch.zeros(batch.num_tokens, dtype=torch.bool)  # (K,)
    chosen[idx] = True
    inside = batch.mem_span_ids >= 0  # (K,)
    outside = agg_weights((chosen & ~inside).float(), "token-mean")
    spans = agg_weights(
        (chosen & inside).float(), "seq-mean-token-mean", seq_ids=batch.mem_span_ids
    )
    return outside + spans


def micro_loss(
    config: TrainerConfig,
    micro: MicroBatch,
    logp: Tensor,
    logits: Tensor,
    tokens: TokenData,
    weights: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the mini-batch loss, and its metric sums (see STATS).

    per token: clipped surrogate (dual clip) + beta * KL(pi || pi_ref) - c * entropy;
    the share: their sum weighted by the mini-batch's ``weights`` (K of the batch, see
    loss_weights). ``logp`` (K,) and ``logits`` (K, V) come from packing.forward_logprobs.
    """
    idx = micro.token_index
    old = tokens.old[idx] if tokens.old is not None else logp.detach()
    pg_loss, pg = ppo_policy_loss(
        logp,
        old,
        tokens.advantages[idx],
        None,
        config.clip_low,
        config.clip_high,
        config.clip_c,
    )
    kl = (
        kl_penalty(logp, tokens.ref[idx], config.kl_kind)
        if tokens.ref is not None
        else torch.zeros_like(logp)
    )
    with torch.set_grad_enabled(config.entropy_coef > 0):
        entropy = entropy_from_logits(logits)  # (K,)
    per_token = pg_loss + config.beta_kl * kl - config.entropy_coef * entropy  # (K,)
    loss = (per_token * weights[idx]).sum()
    k = float(idx.numel())
    stats = {
        "tokens": torch.tensor(k, device=logp.device),
        "pg_loss": pg_loss.detach().sum(),
        "pg_clipfrac": pg["pg_clipfrac"] * k,
        "pg_clipfrac_lower": pg["pg_clipfrac_lower"] * k,
        "ppo_kl": pg["ppo_kl"] * k,
        "kl": kl.detach().sum(),
        "entropy": entropy.detach().sum(),
        "loss": loss.detach(),
    }
    return loss, stats
