"""PPO losses: clipped surrogate with dual clip, KL penalties, loss aggregation.

Numerics follow verl's ``core_algos`` (DESIGN.md section 1): the log-ratio is clamped to
[-20, 20] before ``exp``; the dual clip bounds the loss at ``-A * clip_c`` only where
A < 0; the k3 ("low_var_kl") estimator clamps the log-ratio to [-20, 20] and the result
to [-10, 10]. Losses return per-token values and metrics; ``agg_loss`` is the one place
that reduces them.

Glossary: T tokens (any shape; every tensor of one call shares it).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLKind = Literal["k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "traj-mean-token-mean"]
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "traj-mean-token-mean",
)


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


def agg_loss(
    per_token: Tensor,
    mask: Tensor,
    mode: AggMode = "token-mean",
    seq_ids: Tensor | None = None,
    traj_ids: Tensor | None = None,
    global_denominator: float | Tensor | None = None,
) -> Tensor:
    """Reduce per-token losses to a scalar.

    Args:
        per_token, mask: same shape: (N, L) padded, or (T,) packed.
        mode: "token-mean" (sum / tokens), "seq-mean-token-mean" (token mean per
            sequence, then mean over sequences), "seq-mean-token-sum" (token sum per
            sequence, then mean), "traj-mean-token-mean" (token mean over all rounds of a
            trajectory, then mean over trajectories; the paper's Eq. 10).
        seq_ids: same shape as per_token, the sequence of each token; default: the row
            of a 2-D input (required for a packed 1-D input in the seq modes).
        traj_ids: same shape, the trajectory of each token (traj mode only).
        global_denominator: when this call sees one micro-batch of a larger batch, the
            whole batch's count of tokens / sequences / trajectories, so that the
            micro-batch losses add up to the batch loss. Default: this call's count.
    Sequences and trajectories without a masked-in token are ignored.
    """
    mask = mask.to(per_token.dtype)
    values = (per_token * mask).reshape(-1)
    flat_mask = mask.reshape(-1)
    if mode == "token-mean":
        denom = flat_mask.sum() if global_denominator is None else global_denominator
        return values.sum() / torch.as_tensor(denom, dtype=values.dtype).clamp(min=1.0)
    if mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        if seq_ids is None:
            if per_token.ndim != 2:
                raise ValueError("seq_ids are required for a packed (1-D) input")
            seq_ids = torch.arange(per_token.shape[0], device=per_token.device)[:, None].expand_as(
                per_token
            )
        ids = seq_ids.reshape(-1)
    elif mode == "traj-mean-token-mean":
        if traj_ids is None:
            raise ValueError("traj-mean-token-mean needs traj_ids")
        ids = traj_ids.reshape(-1)
    else:
        raise ValueError(f"unknown loss aggregation {mode!r} ({', '.join(AGG_MODES)})")
    sums, _ = _group_sums(values, ids)
    counts, _ = _group_sums(flat_mask, ids)
    present = counts > 0
    per_unit = sums if mode == "seq-mean-token-sum" else sums / counts.clamp(min=1e-8)
    denom = present.sum() if global_denominator is None else global_denominator
    return (per_unit * present).sum() / torch.as_tensor(denom, dtype=values.dtype).clamp(min=1.0)
