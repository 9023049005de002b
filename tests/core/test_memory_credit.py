"""The memory-credit variants (mem_baseline, mem_gate, mem_norm): plain-loop references
of each definition and parity of mempo.advantages with them over seeds and shapes."""

from __future__ import annotations

import random

import pytest
import torch

from mempo.advantages import gate_success, memory_advantage, memory_rewards
from tests.core.test_advantages import reference_group_norm


def reference_rewards(p_mem: list[float], p_full: list[float], p_task: float, baseline: str) -> list[float]:
    """R_M of each memory of one trajectory: P_mem minus its baseline."""
    out = []
    for t, pm in enumerate(p_mem):
        if baseline == "full":
            out.append(pm - p_full[t])
        elif baseline == "none":
            out.append(pm - p_task)
        else:  # prev: the previous memory's P_mem; P_task before the first
            out.append(pm - (p_mem[t - 1] if t > 0 else p_task))
    return out


def reference_advantage(
    rewards: list[float], pools: list[int], rounds: list[int], norm: str, min_std: float
) -> list[float]:
    """z-score per pool (pool), per (pool, round index) (round), or centred per pool."""
    keys = [(p, r) if norm == "round" else (p, 0) for p, r in zip(pools, rounds, strict=True)]
    ids = [sorted(set(keys)).index(k) for k in keys]
    return reference_group_norm(rewards, ids, norm=norm != "centred", min_std=min_std)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("baseline", ["full", "none", "prev"])
def test_memory_rewards_match_the_reference(seed: int, baseline: str) -> None:
    rng = random.Random(seed)
    rounds = rng.randint(1, 6)
    p_mem = [rng.random() for _ in range(rounds)]
    p_full = [rng.random() for _ in range(rounds)]
    p_task = rng.random()
    got = memory_rewards(torch.tensor(p_mem), torch.tensor(p_full), p_task, baseline)  # type: ignore[arg-type]
    assert got.tolist() == pytest.approx(reference_rewards(p_mem, p_full, p_task, baseline), abs=1e-6)


def test_the_baselines_on_a_hand_case() -> None:
    p_mem, p_full = torch.tensor([0.2, 0.5, 0.4]), torch.tensor([0.1, 0.1, 0.6])
    assert memory_rewards(p_mem, p_full, None).tolist() == pytest.approx([0.1, 0.4, -0.2])
    assert memory_rewards(p_mem, p_full, 0.05, "none").tolist() == pytest.approx([0.15, 0.45, 0.35])
    assert memory_rewards(p_mem, p_full, 0.05, "prev").tolist() == pytest.approx([0.15, 0.3, -0.1])
    with pytest.raises(ValueError, match="needs P_task"):
        memory_rewards(p_mem, p_full, None, "prev")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("norm", ["pool", "round", "centred"])
@pytest.mark.parametrize("min_std", [0.0, 0.05, 0.3])
def test_memory_advantage_variants_match_the_reference(seed: int, norm: str, min_std: float) -> None:
    rng = random.Random(seed)
    pools, rounds, rewards = [], [], []
    for pool in range(rng.randint(1, 4)):
        for _ in range(rng.randint(1, 4)):  # trajectories
            for t in range(rng.randint(1, 4)):
                pools.append(pool)
                rounds.append(t)
                rewards.append(rng.choice([rng.uniform(-1, 1), 0.25]))  # ties: zero-variance cells
    got = memory_advantage(torch.tensor(rewards), torch.tensor(pools), 1e-6, min_std, norm, torch.tensor(rounds))  # type: ignore[arg-type]
    assert got.tolist() == pytest.approx(reference_advantage(rewards, pools, rounds, norm, min_std), rel=1e-4, abs=1e-5)


def test_centred_keeps_probability_units_and_round_normalises_each_round() -> None:
    rewards, pools, rounds = torch.tensor([0.1, 0.2, 0.3, 0.9]), torch.tensor([0, 0, 0, 0]), torch.tensor([0, 0, 1, 1])
    centred = memory_advantage(rewards, pools, min_std=0.0, norm="centred")
    assert centred.tolist() == pytest.approx([-0.275, -0.175, -0.075, 0.525])
    per_round = memory_advantage(rewards, pools, min_std=0.0, norm="round", round_ids=rounds)
    assert per_round[0] < 0 < per_round[1] and per_round[2] < 0 < per_round[3]
    assert per_round[:2].sum().item() == pytest.approx(0.0, abs=1e-6)
    assert memory_advantage(rewards, pools, min_std=0.5, norm="centred").abs().sum() == 0  # the guard holds
    with pytest.raises(ValueError, match="round_ids"):
        memory_advantage(rewards, pools, norm="round")


def test_success_gate_zeroes_the_memories_of_failed_trajectories() -> None:
    adv = torch.tensor([0.5, -1.0, 2.0, -0.3])
    assert gate_success(adv, torch.tensor([1.0, 0.0, 0.5, -1.0])).tolist() == [0.5, 0.0, 2.0, 0.0]
