"""PPO losses: clipped surrogate with dual clip, KL penalties, loss aggregation.

Numerics follow verl's ``core_algos`` (docs/architecture.md, 'The algorithm'): the
log-ratio is clamped to [-20, 20] before ``exp``; the dual clip bounds the loss at
``-A * clip_c`` only where A < 0; the k3 ("low_var_kl") estimator clamps the log-ratio
to [-20, 20] and the result to [-10, 10]. Losses return per-token values and metrics;
``agg_weights`` is the one definition of how they are reduced (per-token weights), and
``agg_loss`` applies it.

Glossary: T tokens (any shape; every tensor of one call shares it).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

KLKind = Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "traj-mean-token-mean"]
AGG_MODES: tuple[AggMode, ...] = get_args(AggMode)


def _masked_mean(values: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: KLKind = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (shape T).

    k1/"kl": logp - ref; k2/"mse": 0.5 (logp - ref)^2; "abs": |logp - ref|;
    k3/"low_var_kl": r - log r - 1 with log r = clamp(ref - logp, -20, 20), clamped to [-10, 10].
    """
    if kind in ("k1", "kl"):
        return logp - ref_logp
    if kind in ("k2", "mse"):
        return 0.5 * (logp - ref_logp).square()
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("k3", "low_var_kl"):
        log_ratio = torch.clamp(ref_logp - logp, -20.0, 20.0)
        return torch.clamp(log_ratio.exp() - log_ratio - 1.0, -10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r} (k1, k2, k3, low_var_kl, abs)")


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate with dual clip, per token (all tensors shape T).

    loss = max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high)), and where A < 0 it is
    further bounded by -A * clip_c. Metrics (masked means, tensors; no ``.item()``):
    pg_clipfrac (the clamp was active), pg_clipfrac_lower (the dual clip was active),
    ppo_kl (mean of old_logp - logp, the approximate KL to the behaviour policy).
    """
    if clip_c <= 1.0:
        raise ValueError(f"clip_c must exceed 1.0 (got {clip_c})")
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = log_ratio.exp()
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -advantages * clip_c
    dual = torch.minimum(loss3, clipped)
    loss = torch.where(advantages < 0, dual, clipped)
    metrics = {
        "pg_clipfrac": _masked_mean(torch.gt(loss2, loss1).float(), mask).detach(),
        "pg_clipfrac_lower": _masked_mean(
            ((clipped > loss3) & (advantages < 0)).float(), mask
        ).detach(),
        "ppo_kl": _masked_mean(-log_ratio, mask).detach(),
    }
    return loss, metrics


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical at every position: (..., V) -> (...)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _group_sums(values: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Sum values per id; returns (sums per unique id, inverse index)."""
    _, inverse = torch.unique(ids, return_inverse=True)
    sums = torch.zeros(
        int(inverse.max()) + 1 if inverse.numel() else 0, dtype=values.dtype, device=values.device
    )
    return sums.index_add_(0, inverse, values), inverse


def _unit_ids(
    mode: AggMode, mask: Tensor, seq_ids: Tensor | None, traj_ids: Tensor | None
) -> Tensor:
    """The unit each token is averaged in under ``mode``: its sequence or its trajectory."""
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        if seq_ids is not None:
            return seq_ids
        if mask.ndim != 2:
            raise ValueError("seq_ids are required for a packed (1-D) input")
        return torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    if mode == "traj-mean-token-mean":
        if traj_ids is None:
            raise ValueError("traj-mean-token-mean needs traj_ids")
        return traj_ids
    raise ValueError(f"unknown loss aggregation {mode!r} ({', '.join(AGG_MODES)})")


def agg_weights(
    mask: Tensor,
    mode: AggMode = "token-mean",
    seq_ids: Tensor | None = None,
    traj_ids: Tensor | None = None,
) -> Tensor:
    """The weight of every token's loss under ``mode``: agg_loss = sum(weights * per_token).

    This is the one definition of the modes. A token outside ``mask`` weighs 0; a token
    inside weighs, for token-mean, 1 / tokens; seq-mean-token-mean, 1 / (sequences x
    tokens of its sequence); seq-mean-token-sum, 1 / sequences; traj-mean-token-mean,
    1 / (trajectories x tokens of its trajectory over all its rounds). Tokens, sequences
    and trajectories are counted inside ``mask`` only.

    Weights taken over a whole mini-batch add up over any split of it into micro-batches
    (and ranks) to exactly the mini-batch's loss, even where a trajectory's rounds fall
    into different micro-batches. Arguments as agg_loss's; the result has mask's shape.
    """
    dtype = mask.dtype if mask.is_floating_point() else torch.get_default_dtype()
    weights = mask.to(dtype)
    if mode == "token-mean":
        return weights / weights.sum().clamp(min=1.0)
    ids = _unit_ids(mode, mask, seq_ids, traj_ids)
    counts, inverse = _group_sums(weights.reshape(-1), ids.reshape(-1))
    units = (counts > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return weights / units
    return weights / (units * counts[inverse].clamp(min=1e-8)).reshape(weights.shape)


def agg_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: AggMode = "token-mean",
    seq_ids: Tensor | None = None,
    traj_ids: Tensor | None = None,
) -> Tensor:
    """Reduce per-token losses to a scalar: sum(agg_weights(mask, mode, ...) * per_token).

    Args:
        per_token, mask: same shape: (N, L) padded, or (T,) packed.
        mode: "token-mean" (sum / tokens), "seq-mean-token-mean" (token mean per
            sequence, then mean over sequences), "seq-mean-token-sum" (token sum per
            sequence, then mean), "traj-mean-token-mean" (token mean over all rounds of a
            trajectory, then mean over trajectories; the paper's Eq. 10).
        seq_ids: same shape as per_token, the sequence of each token; default: the row
            of a 2-D input (required for a packed 1-D input in the seq modes).
        traj_ids: same shape, the trajectory of each token (traj mode only).
    Sequences and trajectories without a masked-in token are ignored. For one
    micro-batch of a larger batch, weigh its tokens by agg_weights of the whole batch.
    """
    weights = agg_weights(mask.to(per_token.dtype), mode, seq_ids, traj_ids)
    return (per_token * weights).sum()
