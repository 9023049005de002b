"""Advantages: GRPO outcome advantage, MemPO's memory advantage, per-token assembly.

Glossary: B trajectories, K (trajectory, round) memory items, N training sequences,
L tokens per sequence, S memory spans.

Numerics (docs/architecture.md, 'The algorithm'): std is the unbiased (n-1) estimator,
eps = 1e-6. A group (or pool) of size 1, or with zero variance, gets advantage 0. This
differs from verl, whose size-1 group returns the raw score (mean 0, std 1); we follow
slime, since a lone sample carries no relative signal. With ``norm_by_std=False``
(Dr.GRPO) the advantage is the centred reward, and a size-1 group still gets 0.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

MemBaseline = Literal["full", "none", "prev"]
MemGate = Literal["all", "success"]
MemNorm = Literal["pool", "round", "centred"]

# The default memory-advantage guard (docs/architecture.md, 'The algorithm': pools whose
# spread is noise must not drive the <mem> tokens). R_M = P_mem - P_full lies in [-1, 1].
# A policy that cannot answer has every P near 0 and pools whose std is about 0.01
# (measured, docs/results.md); a pool where some memories hold the answer and others do
# not has P_mem values apart by tenths and a std far above 0.05. Below it, A_M is 0;
# above it, the definition is unchanged.
MEM_MIN_STD = 0.05


def _group_normalize(
    values: Tensor, ids: Tensor, eps: float, norm_by_std: bool, min_std: float = 0.0
) -> Tensor:
    """(x - mean_g) / (std_g + eps) within each id; 0 for size-1 or zero-variance groups,
    and for groups whose std is below ``min_std``."""
    values = values.to(torch.float32)
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)  # (G,)
    num_groups = counts.numel()
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(
        0, inverse, values
    )
    counts_f = counts.to(values.dtype)
    mean = sums / counts_f  # (G,)
    centred = values - mean[inverse]  # (B,)
    sq = torch.zeros_like(sums).index_add_(0, inverse, centred * centred)
    var = sq / (counts_f - 1).clamp(min=1)  # unbiased; size-1 handled below
    std = var.sqrt()
    # Zero variance is tested exactly (max == min), not as std > 0: float rounding can
    # leave a tiny std in a constant group, which eps would turn into a spurious signal.
    gmax = torch.full_like(sums, -torch.inf).scatter_reduce(0, inverse, values, "amax")
    gmin = torch.full_like(sums, torch.inf).scatter_reduce(0, inverse, values, "amin")
    constant = gmax == gmin  # (G,)
    degenerate = (counts <= 1) | constant | (std < min_std)  # (G,)
    out = centred / (std[inverse] + eps) if norm_by_std else centred
    return torch.where(degenerate[inverse], torch.zeros_like(out), out)


def grpo_outcome_advantage(
    rewards: Tensor, group_ids: Tensor, eps: float = 1e-6, norm_by_std: bool = True
) -> Tensor:
    """A_T(i) = (R_T(i) - mean_group) / (std_group + eps).

    Args:
        rewards: (B,) outcome reward of each trajectory.
        group_ids: (B,) integer group (task) of each trajectory.
    Returns:
        (B,) float32 advantages; 0 for a group of size 1 or with zero variance.
    """
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D"
        )
    return _group_normalize(rewards, group_ids, eps, norm_by_std)


def memory_rewards(
    p_mem: Tensor, p_full: Tensor, p_task: float | None, baseline: MemBaseline = "full"
) -> Tensor:
    """R_M of one trajectory's memories (its rounds with a memory, in order): P_mem minus
    the baseline. full: P_full (MemPO); none: P_task, the task alone with an empty memory
    (InfoMem); prev: the previous memory's P_mem, P_task for the first (HiMPO).

    Args:
        p_mem, p_full: (T,) of each round with a memory.
        p_task: the gold answer's probability given the task alone (none and prev need it).
    Returns:
        (T,) float32 rewards.
    """
    p_mem, p_full = p_mem.to(torch.float32), p_full.to(torch.float32)
    if baseline == "full":
        return p_mem - p_full
    if p_task is None:
        raise ValueError(f"mem_baseline {baseline!r} needs P_task (the scorer's task_score)")
    start = torch.full((1,), p_task, dtype=torch.float32)
    if baseline == "none":
        return p_mem - start
    if baseline == "prev":
        return p_mem - torch.cat([start, p_mem[:-1]])
    raise ValueError(f"unknown mem_baseline {baseline!r}")


def memory_advantage(
    mem_rewards: Tensor,
    pool_ids: Tensor,
    eps: float = 1e-6,
    min_std: float = MEM_MIN_STD,
    norm: MemNorm = "pool",
    round_ids: Tensor | None = None,
) -> Tensor:
    """A_M(i,t) = (R_M(i,t) - mean_pool) / (std_pool + eps), R_M = P_mem - P_full.

    ``min_std`` extends the zero-variance rule: a pool whose std is below it gets
    advantage 0 (``MEM_MIN_STD`` by default; 0 leaves only the zero-variance rule). A
    policy that rarely knows the answer has P_mem - P_full values that differ by noise
    (all P ~ 0.01), which the normalisation would turn into unit-scale advantages that
    make the policy drift (measured in docs/results.md).

    ``norm``: pool (above, MemPO's); round (the same per round index within the pool,
    ``round_ids`` required); centred (R_M - mean_pool, not divided by the std, which
    keeps the memory term in probability units; a pool below ``min_std`` still gets 0).

    Args:
        mem_rewards: (K,) memory reward of each (trajectory, round) with a memory.
        pool_ids: (K,) pool of each item: every round of every trajectory of one group.
        min_std: pools with a smaller std get no memory advantage.
        round_ids: (K,) round index of each item (norm round).
    Returns:
        (K,) float32 advantages; 0 for a pool of size 1, with zero variance, or with a
        std below ``min_std``.
    """
    if mem_rewards.shape != pool_ids.shape or mem_rewards.ndim != 1:
        raise ValueError(
            f"mem_rewards {tuple(mem_rewards.shape)} and pool_ids {tuple(pool_ids.shape)} must be equal 1-D"
        )
    if min_std < 0:
        raise ValueError(f"min_std must be >= 0 (got {min_std})")
    if norm == "round":
        if round_ids is None or round_ids.shape != pool_ids.shape:
            raise ValueError("norm round needs round_ids of the pools' shape")
        if pool_ids.numel():
            pool_ids = pool_ids * (int(round_ids.max()) + 1) + round_ids
    elif norm not in ("pool", "centred"):
        raise ValueError(f"unknown mem_norm {norm!r}")
    return _group_normalize(mem_rewards, pool_ids, eps, norm_by_std=norm != "centred", min_std=min_std)


def gate_success(mem_advantages: Tensor, item_rewards: Tensor) -> Tensor:
    """A_M times 1[R_T > 0]: memories of trajectories that failed get no memory credit.

    Args:
        mem_advantages: (K,) after normalisation.
        item_rewards: (K,) outcome reward R_T of each item's trajectory.
    """
    return torch.where(item_rewards > 0, mem_advantages.to(torch.float32), torch.zeros_like(mem_advantages, dtype=torch.float32))


def token_advantages(
    sequence_advantages: Tensor,
    loss_mask: Tensor,
    span_sequence: Tensor,
    span_start: Tensor,
    span_end: Tensor,
    span_advantages: Tensor,
    alpha: float = 1.0,
) -> Tensor:
    """Per-token advantages: A_T of the sequence's trajectory everywhere it trains, plus
    ``alpha * A_M`` inside each <mem> span.

    In memory mode each round is a sequence with at most one span; in full mode one
    sequence holds every round and so several spans. Tokens outside ``loss_mask``
    (prompts, information) get 0.

    Args:
        sequence_advantages: (N,) outcome advantage of each sequence's trajectory.
        loss_mask: (N, L) 1 where the token is a trained response token.
        span_sequence: (S,) sequence index of each memory span.
        span_start, span_end: (S,) token offsets [start, end) in the sequence.
        span_advantages: (S,) memory advantage of each span.
    Returns:
        (N, L) float32 advantages.
    """
    n, length = loss_mask.shape
    mask = loss_mask.to(torch.float32)
    adv = sequence_advantages.to(torch.float32)[:, None].expand(n, length).clone()  # (N, L)
    if span_sequence.numel():
        pos = torch.arange(length, device=loss_mask.device)[None, :]  # (1, L)
        inside = (pos >= span_start[:, None]) & (pos < span_end[:, None])  # (S, L)
        bonus = alpha * span_advantages.to(torch.float32)[:, None] * inside  # (S, L)
        adv.index_add_(0, span_sequence.long(), bonus)
    return adv * mask


def scale_negative(advantages: Tensor, scale: float) -> Tensor:
    """Multiply every negative advantage by ``scale``; positive and zero ones are unchanged.

    ``scale`` = 1 is the definition (docs/architecture.md, 'The algorithm'). A tiny policy
    that succeeds on 10-20% of rollouts gives most of them a negative advantage; pushing
    down tokens sampled at T=1 spreads probability mass onto garbage and the policy
    drifts. Scaling negative advantages by 0.2 kept it stable (measured in issue 23,
    docs/results.md).

    Args:
        advantages: any shape, e.g. (N, L) per-token or (K,) trained-token advantages.
        scale: in (0, 1].
    Returns:
        float32 tensor of the same shape.
    """
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1] (got {scale})")
    adv = advantages.to(torch.float32)
    return torch.where(adv < 0, adv * scale, adv)
