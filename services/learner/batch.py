"""Groups -> training sequences with per-token advantages.

The definitions: docs/architecture.md, 'The algorithm' (advantages), docs/trainer.md,
'One step' (sequences), docs/rollout.md, 'The agent format' (the rounds they come from).

Memory mode: every round is one sequence, ``prompt_ids + response_ids``, trained on the
response. Full mode: a trajectory is one sequence, the last round's prompt + response,
which already holds every earlier round; the loss covers every round's response (round
t's starts at ``len(rounds[t].prompt_ids)``) and never a prompt or an information block.
A full-mode trajectory whose rounds are not prefix-consistent trains round by round
instead (the same tokens, more compute).

Advantages come from mempo.advantages only: A_T per trajectory over its group, A_M per
(trajectory, round with a memory) pooled over its group, assembled per token with the
<mem> spans shifted to sequence offsets. The trainer sees nothing but these tensors.

Per-token tensors live in *trained-token space*: the trained tokens of every sequence,
concatenated in sequence order, each sequence's in position order.

Glossary: G groups, B trajectories, N sequences, K trained tokens, M memory items,
S memory spans, L longest sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from mempo.advantages import (
    MEM_MIN_STD,
    MemBaseline,
    MemGate,
    MemNorm,
    gate_success,
    grpo_outcome_advantage,
    memory_advantage,
    memory_rewards,
    scale_negative,
    token_advantages,
)
from mempo.schemas import Group, Trajectory


@dataclass(frozen=True)
class TrainSequence:
    """One training sequence: its ids and which of them carry the loss."""

    input_ids: np.ndarray  # (L_i,) int64
    positions: np.ndarray  # (n_i,) int64, ascending, >= 1: the trained (response) tokens
    rollout_logprobs: np.ndarray  # (n_i,) float64: the engine's log-prob of each trained token
    trajectory: int = 0  # index of its trajectory in the batch
    temperature: float = 1.0  # the T of the log-probs: log_softmax(logits / T) (Group's)
    rounds: tuple[int, ...] = ()  # round indices it covers
    spans: tuple[tuple[int, int, int], ...] = ()  # (start, end, round index) of <mem> spans

    @property
    def num_trained(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class TrainingBatch:
    """What one training step consumes; all per-token tensors are (K,)."""

    sequences: list[TrainSequence]
    offsets: np.ndarray  # (N + 1,) sequence i owns trained tokens [offsets[i], offsets[i + 1])
    advantages: Tensor  # (K,) float32
    rollout_logprobs: Tensor  # (K,) float32
    in_memory: Tensor  # (K,) bool: inside a <mem> span that has a memory advantage
    mem_span_ids: Tensor  # (K,) int64: the <mem> span of each token (S of the batch), -1 outside
    seq_ids: Tensor  # (K,) int64
    traj_ids: Tensor  # (K,) int64
    stats: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, sequences: list[TrainSequence]) -> TrainingBatch:
        """A batch of ``sequences`` with zero advantages (SFT, tests); build_batch fills them."""
        counts = torch.tensor([s.num_trained for s in sequences], dtype=torch.long)  # (N,)
        k = int(counts.sum())
        traj = torch.tensor([s.trajectory for s in sequences], dtype=torch.long)  # (N,)
        offsets = np.concatenate([[0], np.cumsum(counts.numpy())]).astype(np.int64)
        span_ids, next_span = np.full(k, -1, dtype=np.int64), 0  # (K,)
        for seq, offset in zip(sequences, offsets, strict=False):
            for start, end, _ in seq.spans:
                lo, hi = np.searchsorted(seq.positions, (start, end))
                span_ids[offset + lo : offset + hi] = next_span
                next_span += 1
        return cls(
            sequences=sequences,
            offsets=offsets,
            advantages=torch.zeros(k),
            rollout_logprobs=torch.from_numpy(
                np.concatenate([s.rollout_logprobs for s in sequences])
            ).float(),
            in_memory=torch.zeros(k, dtype=torch.bool),
            mem_span_ids=torch.from_numpy(span_ids),
            seq_ids=torch.repeat_interleave(torch.arange(len(sequences)), counts),
            traj_ids=torch.repeat_interleave(traj, counts),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def token_index(self, seqs: Sequence[int]) -> Tensor:
        """Trained-token indices of ``seqs``, concatenated in the given order: (k,)."""
        if not seqs:
            return torch.zeros(0, dtype=torch.long)
        return torch.from_numpy(
            np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in seqs])
        )


# --------------------------------------------------------------------------- sequences


def _round_sequence(traj: Trajectory, t: int, b: int, temperature: float) -> TrainSequence:
    rnd = traj.rounds[t]
    prompt, response = rnd.prompt_ids.numpy(), rnd.response_ids.numpy()
    start = len(prompt)
    spans = () if rnd.mem_span is None else ((start + rnd.mem_span[0], start + rnd.mem_span[1], t),)
    return TrainSequence(
        input_ids=np.concatenate([prompt, response]).astype(np.int64),
        positions=np.arange(start, start + len(response), dtype=np.int64),
        rollout_logprobs=rnd.response_logprobs.numpy(),
        trajectory=b,
        temperature=temperature,
        rounds=(t,),
        spans=spans,
    )


def _full_sequence(traj: Trajectory, b: int, temperature: float) -> TrainSequence | None:
    """The trajectory as one sequence, or None when its rounds are not prefix-consistent."""
    last = traj.rounds[-1]
    ids = np.concatenate([last.prompt_ids.numpy(), last.response_ids.numpy()]).astype(np.int64)
    positions, logprobs, spans = [], [], []
    for t, rnd in enumerate(traj.rounds):
        prompt, response = rnd.prompt_ids.numpy(), rnd.response_ids.numpy()
        start, end = len(prompt), len(prompt) + len(response)
        if end > len(ids) or not (
            np.array_equal(ids[:start], prompt) and np.array_equal(ids[start:end], response)
        ):
            return None
        positions.append(np.arange(start, end, dtype=np.int64))
        logprobs.append(rnd.response_logprobs.numpy())
        if rnd.mem_span is not None:
            spans.append((start + rnd.mem_span[0], start + rnd.mem_span[1], t))
    return TrainSequence(
        input_ids=ids,
        positions=np.concatenate(positions),
        rollout_logprobs=np.concatenate(logprobs),
        trajectory=b,
        temperature=temperature,
        rounds=tuple(range(len(traj.rounds))),
        spans=tuple(spans),
    )


def trajectory_sequences(
    traj: Trajectory, full_mode: bool, b: int = 0, temperature: float = 1.0
) -> list[TrainSequence]:
    """The sequences a trajectory trains as; those without a trained token are left out.
    ``temperature``: the T its log-probs were taken at (``Group.logprob_temperature``)."""
    whole = _full_sequence(traj, b, temperature) if full_mode else None
    sequences = (
        [whole]
        if whole is not None
        else [_round_sequence(traj, t, b, temperature) for t in range(len(traj.rounds))]
    )
    return [s for s in sequences if s.num_trained > 0]


def validate_group(group: Group, vocab_size: int, max_tokens: int | None = None) -> str | None:
    """Why the trainer cannot use this group (a reason for the dead stream), or None.

    The wire schema already holds every number in range (finite log-probs <= 0, rewards
    and P_mem / P_full in [0, 1]); here: token ids inside this model's vocabulary, rounds
    of at most ``max_tokens`` prompt + response tokens, and at least one response token
    (a group of empty responses has nothing to train on, and a batch of such groups alone
    would fail the step)."""
    if not any(len(r.response_ids) for t in group.trajectories for r in t.rounds):
        return "every response is empty: no response token to train on"
    for traj in group.trajectories:
        for rnd in traj.rounds:
            length = len(rnd.prompt_ids) + len(rnd.response_ids)
            if max_tokens is not None and length > max_tokens:
                return (
                    f"trajectory {traj.trajectory_id} round {rnd.index}: {length} tokens, over the "
                    f"learner's max_sequence_tokens of {max_tokens}"
                )
            for name in ("prompt_ids", "response_ids"):
                ids = getattr(rnd, name).numpy()
                if ids.size and int(ids.max()) >= vocab_size:
                    return (
                        f"trajectory {traj.trajectory_id} round {rnd.index}: {name} holds token id "
                        f"{int(ids.max())}, outside the model's vocabulary of {vocab_size}"
                    )
    return None


# --------------------------------------------------------------------------- advantages


@dataclass
class _Flat:
    """Every trajectory and memory item of the batch, flattened."""

    rewards: list[float] = field(default_factory=list)  # (B,)
    group_of: list[int] = field(default_factory=list)  # (B,)
    mem_rewards: list[float] = field(default_factory=list)  # (M,)
    mem_pool: list[int] = field(default_factory=list)  # (M,)
    mem_round: list[int] = field(default_factory=list)  # (M,)
    p_mem: list[float] = field(default_factory=list)  # (M,)
    p_full: list[float] = field(default_factory=list)  # (M,)
    item_of: dict[tuple[int, int], int] = field(default_factory=dict)  # (b, round) -> item


def _flatten(groups: Sequence[Group], baseline: MemBaseline = "full") -> tuple[_Flat, list[Trajectory]]:
    flat, trajectories = _Flat(), list[Trajectory]()
    for g, group in enumerate(groups):
        for traj in group.trajectories:
            b = len(trajectories)
            trajectories.append(traj)
            flat.rewards.append(traj.reward)
            flat.group_of.append(g)
            if not traj.p_mem or (baseline != "full" and traj.p_task is None):
                continue  # no scores: its memories get no memory advantage
            mem_rounds = [t for t, r in enumerate(traj.rounds) if r.mem_span is not None]
            r_m = memory_rewards(torch.tensor(traj.p_mem), torch.tensor(traj.p_full), traj.p_task, baseline)
            for t, pm, pf, r in zip(mem_rounds, traj.p_mem, traj.p_full, r_m.tolist(), strict=True):
                flat.item_of[(b, t)] = len(flat.mem_rewards)
                flat.mem_rewards.append(r)
                flat.mem_pool.append(g)
                flat.mem_round.append(t)
                flat.p_mem.append(pm)
                flat.p_full.append(pf)
    return flat, trajectories


def build_batch(
    groups: Sequence[Group],
    alpha: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    mem_min_std: float = MEM_MIN_STD,
    *,
    neg_adv_scale: float = 1.0,
    mem_baseline: MemBaseline = "full",
    mem_gate: MemGate = "all",
    mem_norm: MemNorm = "pool",
) -> TrainingBatch:
    """Groups -> sequences, per-token advantages (A_T + alpha * A_M on <mem> tokens).

    ``neg_adv_scale`` multiplies every negative per-token advantage, after A_T and
    alpha * A_M are combined (mempo.advantages.scale_negative; 1 leaves them unchanged).
    ``mem_*``: how a memory earns its credit (TrainerConfig; the defaults are MemPO's)."""
    if not groups:
        raise ValueError("build_batch needs at least one group")
    flat, trajectories = _flatten(groups, mem_baseline)
    sequences = _sequences(groups, flat, trajectories)
    if not sequences:
        raise ValueError("the batch has no response token to train on")
    outcome = grpo_outcome_advantage(
        torch.tensor(flat.rewards, dtype=torch.float32),
        torch.tensor(flat.group_of),
        eps,
        norm_by_std,
    )  # (B,)
    memory = _memory_advantages(flat, eps, mem_min_std, mem_norm, mem_gate)  # (M,)
    n, length = len(sequences), max(len(s.input_ids) for s in sequences)
    loss_mask = torch.zeros(n, length, dtype=torch.bool)  # (N, L)
    for i, seq in enumerate(sequences):
        loss_mask[i, torch.from_numpy(seq.positions)] = True
    spans = [
        (i, start, end, flat.item_of[(seq.trajectory, t)])
        for i, seq in enumerate(sequences)
        for start, end, t in seq.spans
        if (seq.trajectory, t) in flat.item_of
    ]
    span = torch.tensor(spans, dtype=torch.long).reshape(-1, 4)  # (S, 4): seq, start, end, item
    seq_traj = torch.tensor([s.trajectory for s in sequences])  # (N,)
    per_token = token_advantages(
        outcome[seq_traj], loss_mask, span[:, 0], span[:, 1], span[:, 2], memory[span[:, 3]], alpha
    )  # (N, L)
    per_token = scale_negative(per_token, neg_adv_scale)  # (N, L)
    inside = token_advantages(
        torch.zeros(n), loss_mask, span[:, 0], span[:, 1], span[:, 2], torch.ones(len(spans))
    )  # (N, L): 1 on trained tokens inside a scored span
    batch = TrainingBatch.of(sequences)
    batch.advantages = per_token[loss_mask]  # row-major: sequence order, then position order
    batch.in_memory = inside[loss_mask] > 0
    batch.stats = _stats(groups, trajectories, flat, outcome, memory, batch)
    return batch


def _memory_advantages(flat: _Flat, eps: float, min_std: float, norm: MemNorm, gate: MemGate) -> Tensor:
    """A_M of every memory item (M,): normalised by ``norm``, then gated by ``gate``."""
    memory = memory_advantage(
        torch.tensor(flat.mem_rewards, dtype=torch.float32), torch.tensor(flat.mem_pool, dtype=torch.long),
        eps, min_std, norm, torch.tensor(flat.mem_round, dtype=torch.long),
    )  # fmt: skip
    if gate == "success":
        item_traj = torch.tensor([b for b, _ in sorted(flat.item_of, key=flat.item_of.__getitem__)], dtype=torch.long)
        memory = gate_success(memory, torch.tensor(flat.rewards)[item_traj])
    return memory


def _sequences(
    groups: Sequence[Group], flat: _Flat, trajectories: list[Trajectory]
) -> list[TrainSequence]:
    """Every trajectory's sequences, in trajectory order (trajectory b of the flat batch)."""
    return [
        seq
        for b, traj in enumerate(trajectories)
        for group in (groups[flat.group_of[b]],)
        for seq in trajectory_sequences(
            traj, group.task.mode == "full", b, group.logprob_temperature
        )
    ]


def _stats(
    groups: Sequence[Group],
    trajectories: list[Trajectory],
    flat: _Flat,
    outcome: Tensor,
    memory: Tensor,
    batch: TrainingBatch,
) -> dict[str, float]:
    """Rollout quality and advantage statistics of the batch."""

    def mean(values: Sequence[float]) -> float:
        return float(np.mean(values)) if len(values) else 0.0

    rewards = np.asarray(flat.rewards)
    constant = [np.ptp(rewards[np.asarray(flat.group_of) == g]) == 0 for g in range(len(groups))]
    adv = batch.advantages
    return {
        **_memory_stats(flat, outcome, memory),
        "groups": float(len(groups)),
        "trajectories": float(len(trajectories)),
        "sequences": float(len(batch.sequences)),
        "tokens": float(batch.num_tokens),
        "tokens_total": float(sum(len(s.input_ids) for s in batch.sequences)),
        "reward_mean": mean(flat.rewards),
        "correct_rate": mean([float(t.correct) for t in trajectories]),
        "format_rate": mean([float(t.format_ok) for t in trajectories]),
        "rounds_mean": mean([len(t.rounds) for t in trajectories]),
        "tokens_per_trajectory": mean([t.num_tokens for t in trajectories]),
        "peak_tokens_per_trajectory": mean(
            [max(len(r.prompt_ids) + len(r.response_ids) for r in t.rounds) for t in trajectories]
        ),
        "zero_variance_group_frac": mean([float(c) for c in constant]),
        "mem_items": float(len(flat.mem_rewards)),
        "p_mem_mean": mean(flat.p_mem),
        "p_full_mean": mean(flat.p_full),
        "mem_reward_mean": mean(flat.mem_rewards),
        "adv_outcome_abs_mean": float(outcome.abs().mean()),
        "adv_memory_abs_mean": float(memory.abs().mean()) if memory.numel() else 0.0,
        "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std()) if adv.numel() > 1 else 0.0,
        "adv_abs_max": float(adv.abs().max()),
        "adv_max": float(adv.max()),
        "adv_min": float(adv.min()),
        "mem_reward_std": mean([float(np.std(np.asarray(flat.mem_rewards)[np.asarray(flat.mem_pool) == pool]))
                                for pool in set(flat.mem_pool)]),  # within each group, averaged
        "response_length_mean": mean([len(r.response_ids) for t in trajectories for r in t.rounds]),
        "response_length_max": float(max(len(r.response_ids) for t in trajectories for r in t.rounds)),
        "mem_token_frac": float(batch.in_memory.float().mean()),
    }


def _memory_stats(flat: _Flat, outcome: Tensor, memory: Tensor) -> dict[str, float]:
    """Does the memory advantage help the outcome? ``mem_pool_silenced_frac``: share of
    pools whose A_M is all 0 (too small a spread, mem_min_std); ``mem_adv_agreement``:
    share of items with A_M != 0 and A_T != 0 whose signs agree (below 0.5 the memory
    term mostly fights the outcome on <mem> tokens); ``mem_reward_outcome_corr``: Pearson
    correlation of R_M with its trajectory's reward. A figure without data is left out."""
    if not flat.mem_rewards:
        return {}
    pools = np.asarray(flat.mem_pool)
    a_m = memory.numpy()
    traj_of = np.empty(len(flat.mem_rewards), dtype=np.int64)  # (M,)
    for (b, _), item in flat.item_of.items():
        traj_of[item] = b
    a_t = outcome.numpy()[traj_of]
    stats = {"mem_pool_silenced_frac": float(np.mean([not a_m[pools == p].any() for p in np.unique(pools)]))}
    both = (a_m != 0) & (a_t != 0)
    if both.any():
        stats["mem_adv_agreement"] = float(np.mean(np.sign(a_m[both]) == np.sign(a_t[both])))
    r_m, r = np.asarray(flat.mem_rewards), np.asarray(flat.rewards)[traj_of]
    if len(r_m) > 1 and r_m.std() > 0 and r.std() > 0:
        stats["mem_reward_outcome_corr"] = float(np.corrcoef(r_m, r)[0, 1])
    return stats
