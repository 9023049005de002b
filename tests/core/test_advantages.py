"""Advantages: plain-loop references, equivalence over seeds and shapes, hand cases."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mempo.advantages import (
    grpo_outcome_advantage,
    memory_advantage,
    scale_negative,
    token_advantages,
)


def reference_group_norm(
    values: list[float], ids: list[int], eps: float = 1e-6, norm: bool = True, min_std: float = 0.0
) -> list[float]:
    """The definition, one group at a time (docs/architecture.md, 'The algorithm'); a
    group whose std is below ``min_std`` (the memory advantage's option) gets 0 too."""
    out = [0.0] * len(values)
    for g in set(ids):
        members = [i for i, x in enumerate(ids) if x == g]
        xs = [values[i] for i in members]
        if len(xs) < 2 or max(xs) == min(xs):
            continue  # size 1 or zero variance: advantage 0
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        if std < min_std:
            continue
        for i in members:
            out[i] = (values[i] - mean) / (std + eps) if norm else values[i] - mean
    return out


def reference_token_advantages(
    seq_adv: list[float], mask: list[list[int]], spans: list[tuple[int, int, int, float]], alpha: float
) -> list[list[float]]:
    out = []
    for n, row in enumerate(mask):
        values = []
        for pos, m in enumerate(row):
            a = seq_adv[n]
            for seq, start, end, span_adv in spans:
                if seq == n and start <= pos < end:
                    a += alpha * span_adv
            values.append(a * m)
        out.append(values)
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("binary", [True, False])
def test_grpo_matches_reference(seed: int, binary: bool) -> None:
    rng = random.Random(seed)
    sizes = [rng.randint(1, 9) for _ in range(rng.randint(1, 7))]
    ids = [g for g, size in enumerate(sizes) for _ in range(size)]
    rng.shuffle(ids)
    rewards = [float(rng.random() < 0.5) if binary else rng.gauss(0, 2) for _ in ids]
    for norm in (True, False):
        got = grpo_outcome_advantage(torch.tensor(rewards), torch.tensor(ids), norm_by_std=norm)
        want = reference_group_norm(rewards, ids, norm=norm)
        assert got.tolist() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("min_std", [0.0, 0.1])
def test_memory_advantage_matches_reference(seed: int, min_std: float) -> None:
    rng = random.Random(100 + seed)
    ids = [rng.randint(0, 3) for _ in range(rng.randint(1, 40))]
    scale = rng.choice([1.0, 0.01])  # P_mem - P_full of a competent / a clueless policy
    rewards = [rng.uniform(-scale, scale) for _ in ids]
    got = memory_advantage(torch.tensor(rewards), torch.tensor(ids), min_std=min_std)
    want = reference_group_norm(rewards, ids, min_std=min_std)
    assert got.tolist() == pytest.approx(want, abs=1e-5)


def test_min_std_silences_only_noise_scale_pools() -> None:
    noise, signal = [0.01, 0.0, -0.01], [0.6, 0.0, -0.6]  # std 0.01 and 0.6
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    plain = memory_advantage(torch.tensor(noise + signal), ids, min_std=0.0)
    gated = memory_advantage(torch.tensor(noise + signal), ids)  # the default guard
    assert plain[:3].tolist() == pytest.approx([1.0, 0.0, -1.0], abs=1e-3)  # noise made unit
    assert gated[:3].tolist() == [0.0, 0.0, 0.0]
    assert gated[3:].tolist() == pytest.approx(plain[3:].tolist())  # std above min_std
    with pytest.raises(ValueError, match="min_std"):
        memory_advantage(torch.tensor(noise), torch.tensor([0, 0, 0]), min_std=-1.0)


def test_hand_computed_cases() -> None:
    # group 0: rewards 1, 0 -> mean 0.5, unbiased std sqrt(0.5) = 0.7071
    adv = grpo_outcome_advantage(torch.tensor([1.0, 0.0, 1.0, 0.7]), torch.tensor([0, 0, 1, 2]))
    assert adv[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6))
    assert adv[1].item() == pytest.approx(-0.5 / (math.sqrt(0.5) + 1e-6))
    assert adv[2].item() == 0.0  # size-1 group
    assert adv[3].item() == 0.0  # size-1 group
    # zero variance, including values that do not sum exactly in float
    same = grpo_outcome_advantage(torch.tensor([0.1, 0.1, 0.1]), torch.tensor([5, 5, 5]))
    assert same.tolist() == [0.0, 0.0, 0.0]
    assert memory_advantage(torch.tensor([0.3]), torch.tensor([0])).tolist() == [0.0]


def test_shape_errors() -> None:
    with pytest.raises(ValueError):
        grpo_outcome_advantage(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        memory_advantage(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))


@pytest.mark.parametrize("seed", range(5))
def test_token_advantages_match_reference(seed: int) -> None:
    rng = random.Random(seed)
    n, length = rng.randint(1, 5), rng.randint(1, 12)
    mask = [[int(rng.random() < 0.7) for _ in range(length)] for _ in range(n)]
    seq_adv = [rng.gauss(0, 1) for _ in range(n)]
    spans = []
    for _ in range(rng.randint(0, 6)):
        start = rng.randint(0, length)
        spans.append((rng.randrange(n), start, rng.randint(start, length), rng.gauss(0, 1)))
    alpha = rng.choice([0.0, 0.5, 1.0])
    got = token_advantages(
        torch.tensor(seq_adv),
        torch.tensor(mask),
        torch.tensor([s[0] for s in spans], dtype=torch.long),
        torch.tensor([s[1] for s in spans], dtype=torch.long),
        torch.tensor([s[2] for s in spans], dtype=torch.long),
        torch.tensor([s[3] for s in spans]),
        alpha=alpha,
    )
    want = reference_token_advantages(seq_adv, mask, spans, alpha)
    assert got.shape == (n, length)
    for row_got, row_want in zip(got.tolist(), want, strict=True):
        assert row_got == pytest.approx(row_want, abs=1e-5)


def test_memory_advantage_only_inside_span() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    adv = token_advantages(
        torch.tensor([0.5]), mask, torch.tensor([0]), torch.tensor([3]), torch.tensor([5]), torch.tensor([2.0])
    )
    assert adv.tolist() == [[0.0, 0.0, 0.5, 2.5, 2.5, 0.5, 0.5]]


def reference_scale_negative(values: list[float], scale: float) -> list[float]:
    return [v * scale if v < 0 else v for v in values]


@pytest.mark.parametrize("seed", range(6))
def test_scale_negative_matches_reference(seed: int) -> None:
    rng = random.Random(200 + seed)
    n, length = rng.randint(1, 5), rng.randint(1, 12)
    values = [0.0 if rng.random() < 0.3 else rng.gauss(0, 1) for _ in range(n * length)]
    scale = rng.choice([1.0, 0.5, 0.2, 1e-3])
    got = scale_negative(torch.tensor(values, dtype=torch.float64).reshape(n, length), scale)
    assert got.dtype == torch.float32 and got.shape == (n, length)
    want = reference_scale_negative(values, scale)
    assert got.flatten().tolist() == pytest.approx(want, abs=1e-6)


def test_scale_negative_hand_computed() -> None:
    adv = torch.tensor([[1.5, -2.0, 0.0], [-0.5, 0.25, -1.0]])
    got = scale_negative(adv, 0.2)
    assert got.flatten().tolist() == pytest.approx([1.5, -0.4, 0.0, -0.1, 0.25, -0.2])
    assert scale_negative(adv, 1.0).equal(adv)  # the definition: unchanged


@pytest.mark.parametrize("scale", [0.0, -0.5, 1.5, math.nan])
def test_scale_negative_rejects_scale_outside_unit_interval(scale: float) -> None:
    with pytest.raises(ValueError, match="scale"):
        scale_negative(torch.tensor([-1.0, 1.0]), scale)
