"""The learner's loss against mempo.losses.agg_loss, for every aggregation mode.

The learner splits a mini-batch over ranks and micro-batches and weighs each token by
ppo.loss_weights of the whole mini-batch. Here the same pieces update() runs (loss
weights, the split over ranks, packing.micro_batches, ppo.micro_loss), with stand-in
log-probs for the model's forward, must add up to agg_loss over the whole mini-batch and
to a plain-loop reference, in value and in gradient. The batch has several trajectories
of several rounds each, of varied lengths, and micro-batches small enough that a
trajectory's rounds fall into different micro-batches and ranks.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
from torch import Tensor

from mempo.losses import AGG_MODES, AggMode, agg_loss, ppo_policy_loss
from services.learner.batch import TrainingBatch, TrainSequence
from services.learner.distributed import split_across_ranks
from services.learner.packing import micro_batches
from services.learner.ppo import TokenData, loss_weights, micro_loss, shuffled_minibatches
from services.learner.trainer_config import TrainerConfig


def random_batch(seed: int, trajectories: int = 5) -> TrainingBatch:
    """Trajectories of 2-4 rounds, one sequence per round (shuffled), 6-60 tokens each,
    a random subset of them trained; random advantages."""
    rng = np.random.default_rng(seed)
    sequences = []
    for traj in range(trajectories):
        for rnd in range(int(rng.integers(2, 5))):
            length = int(rng.integers(6, 61))
            trained = int(rng.integers(1, length))
            positions = np.sort(rng.choice(np.arange(1, length), size=trained, replace=False))
            sequences.append(
                TrainSequence(
                    input_ids=rng.integers(0, 50, length),
                    positions=positions.astype(np.int64),
                    rollout_logprobs=np.zeros(trained),
                    trajectory=traj,
                    rounds=(rnd,),
                )
            )
    order = rng.permutation(len(sequences))
    batch = TrainingBatch.of([sequences[i] for i in order])
    batch.advantages = torch.from_numpy(rng.standard_normal(batch.num_tokens)).float()
    return batch


def learner_loss(
    batch: TrainingBatch, mini: list[int], config: TrainerConfig, world: int, tokens: TokenData
) -> tuple[float, Tensor]:
    """update()'s loss for mini-batch ``mini`` summed over ``world`` ranks and their
    micro-batches (rank_micro_batches' split, without the dummies that add nothing), and
    its gradient with respect to the log-probs (K,)."""
    theta = torch.zeros(batch.num_tokens, requires_grad=True)  # stand-in log-probs
    weights = loss_weights(batch, mini, config.loss_agg, config.mem_loss)
    lengths = [len(s.input_ids) for s in batch.sequences]
    total = 0.0
    for share in split_across_ranks(mini, lengths, world):
        for micro in micro_batches(batch, share, config.micro_batch_tokens, config.row_tokens):
            logp = theta[micro.token_index]
            logits = torch.zeros(len(logp), 5)
            loss, stats = micro_loss(config, micro, logp, logits, tokens, weights)
            loss.backward()
            total += float(stats["loss"])
    assert theta.grad is not None
    return total, theta.grad


def reference_loss(
    batch: TrainingBatch, mini: list[int], per_token: list[float], mode: AggMode
) -> float:
    """A mode by plain loops over the mini-batch's sequences: group the trained tokens'
    losses by sequence or trajectory, reduce each group, average over the groups."""
    groups: dict[int, list[float]] = defaultdict(list)
    for i in mini:
        key = batch.sequences[i].trajectory if mode == "traj-mean-token-mean" else i
        groups[key] += per_token[batch.offsets[i] : batch.offsets[i + 1]]
    if mode == "token-mean":
        values = [v for group in groups.values() for v in group]
        return sum(values) / len(values)
    if mode == "seq-mean-token-sum":
        return sum(sum(g) for g in groups.values()) / len(groups)
    return sum(sum(g) / len(g) for g in groups.values()) / len(groups)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_losses_add_up_to_agg_loss_of_the_mini_batch(mode: AggMode) -> None:
    config = TrainerConfig(
        loss_agg=mode, beta_kl=0.0, micro_batch_tokens=64, row_tokens=32, mini_batches=3
    )
    for seed in range(3):
        batch = random_batch(seed)
        generator = torch.Generator().manual_seed(seed)
        old = 0.3 * torch.randn(batch.num_tokens, generator=generator)  # ratio != 1: clipping
        tokens = TokenData(advantages=batch.advantages, old=old, ref=None)
        whole = list(range(len(batch.sequences)))
        minis = [whole, *shuffled_minibatches(len(whole), config.mini_batches, seed, 0, 0)]
        for mini, world in zip(minis, (1, 2, 1, 2), strict=True):
            got, grad = learner_loss(batch, mini, config, world, tokens)
            idx = batch.token_index(mini)
            theta = torch.zeros(batch.num_tokens, requires_grad=True)
            per_token, _ = ppo_policy_loss(theta, old, batch.advantages)
            want = agg_loss(
                per_token[idx], torch.ones(len(idx)), mode, batch.seq_ids[idx], batch.traj_ids[idx]
            )
            want.backward()
            loop = reference_loss(batch, mini, per_token.tolist(), mode)
            assert got == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-6)
            assert got == pytest.approx(loop, rel=1e-5, abs=1e-6)
            torch.testing.assert_close(grad, theta.grad, rtol=1e-5, atol=1e-7)


def test_a_trajectory_spans_micro_batches_and_ranks() -> None:
    """The test above exercises what it claims: rounds of one trajectory land in several
    micro-batches and on both ranks, and micro-batches hold several sequences."""
    batch = random_batch(0)
    lengths = [len(s.input_ids) for s in batch.sequences]
    micros = [
        micro_batches(batch, share, 64, 32)
        for share in split_across_ranks(range(len(lengths)), lengths, 2)
    ]
    places: dict[int, set[tuple[int, int]]] = defaultdict(set)
    for rank, mine in enumerate(micros):
        for m, micro in enumerate(mine):
            for i in micro.sequences:
                places[batch.sequences[i].trajectory].add((rank, m))
    assert any(len({rank for rank, _ in p}) == 2 for p in places.values())
    assert any(len([m for rank, m in p if rank == 0]) > 1 for p in places.values())
    assert any(len(micro.sequences) > 1 for mine in micros for micro in mine)
