"""build_batch with every memory-credit variant (mem_baseline, mem_gate, mem_norm) against
a plain-loop reference on real rollouts of the tiny model; the defaults are MemPO's."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from mempo.schemas import Group
from services.learner.batch import build_batch
from tests.core.test_advantages import reference_group_norm
from tests.core.test_memory_credit import reference_advantage, reference_rewards
from tests.services.learner.factories import cached_groups


def with_p_task(groups: list[Group], seed: int) -> list[Group]:
    """Each group's trajectories with one P_task (the same for a task, as the scorer gives)."""
    rng = random.Random(seed)
    out = []
    for group in groups:
        p_task = rng.uniform(0.0, 0.3)
        trajs = [t.model_copy(update={"p_task": p_task}) for t in group.trajectories]
        out.append(group.model_copy(update={"trajectories": trajs}))
    return out


def expected_memory(groups: list[Group], baseline: str, gate: str, norm: str, min_std: float) -> dict[tuple[int, int], float]:
    """(trajectory of the batch, round) -> A_M, by plain loops."""
    out: dict[tuple[int, int], float] = {}
    b = 0
    for group in groups:
        keys, rewards, rounds = [], [], []
        for i, traj in enumerate(group.trajectories):
            mem_rounds = [r.index for r in traj.rounds if r.mem_span]
            if not traj.p_mem:
                continue
            for t, r in zip(mem_rounds, reference_rewards(traj.p_mem, traj.p_full, traj.p_task or 0.0, baseline), strict=True):
                keys.append((b + i, t))
                rewards.append(r)
                rounds.append(t)
        advantages = reference_advantage(rewards, [0] * len(rewards), rounds, norm, min_std)
        for (traj_b, t), a in zip(keys, advantages, strict=True):
            reward = group.trajectories[traj_b - b].reward
            out[(traj_b, t)] = a if gate == "all" or reward > 0 else 0.0
        b += len(group.trajectories)
    return out


@pytest.mark.parametrize("baseline", ["full", "none", "prev"])
@pytest.mark.parametrize(("gate", "norm"), [("all", "pool"), ("success", "pool"), ("all", "round"), ("success", "centred")])
def test_every_variant_lands_its_reference_on_the_mem_tokens(
    tiny_model_dir: Path, baseline: str, gate: str, norm: str
) -> None:
    groups = with_p_task(cached_groups(tiny_model_dir, 2, mode="memory"), seed=1)
    batch = build_batch(groups, alpha=1.0, mem_min_std=0.0, mem_baseline=baseline, mem_gate=gate, mem_norm=norm)  # type: ignore[arg-type]
    memory = expected_memory(groups, baseline, gate, norm, 0.0)
    trajectories = [t for g in groups for t in g.trajectories]
    outcome = {}
    b = 0
    for group in groups:
        for i, value in enumerate(reference_group_norm([t.reward for t in group.trajectories], [0] * len(group.trajectories))):
            outcome[b + i] = value
        b += len(group.trajectories)
    checked = 0
    for i, seq in enumerate(batch.sequences):
        (t,) = seq.rounds
        rnd = trajectories[seq.trajectory].rounds[t]
        got = batch.advantages[batch.offsets[i] : batch.offsets[i + 1]].numpy()
        span = rnd.mem_span or (0, 0)
        start = len(rnd.prompt_ids)
        want = [outcome[seq.trajectory] + (memory.get((seq.trajectory, t), 0.0) if span[0] <= p - start < span[1] else 0.0)
                for p in seq.positions]  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        checked += int(span[1] > span[0])
    assert checked > 0 and any(abs(v) > 0 for v in memory.values())


def test_without_p_task_the_new_baselines_give_no_memory_credit(tiny_model_dir: Path) -> None:
    groups = cached_groups(tiny_model_dir, 2, mode="memory")  # scored without task_score
    plain = build_batch(groups, alpha=0.0)
    for baseline in ("none", "prev"):
        assert build_batch(groups, alpha=1.0, mem_baseline=baseline).advantages.equal(plain.advantages)  # type: ignore[arg-type]
    assert not build_batch(groups, alpha=1.0).advantages.equal(plain.advantages)  # full: credit as before
