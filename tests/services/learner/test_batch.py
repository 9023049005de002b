"""Groups -> sequences and per-token advantages (services/learner/batch.py)."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from mempo.schemas import Group, Round, Trajectory
from services.learner.batch import build_batch, trajectory_sequences, validate_group
from services.learner.trainer_config import TrainerConfig
from tests.services.learner.factories import cached_groups

EPS = 1e-6


def _normalized(values: list[float], min_std: float = 0.0) -> list[float]:
    """The plain-loop reference: (x - mean) / (unbiased std + eps); 0 for size 1, constant,
    or a std below min_std."""
    if len(values) < 2 or max(values) == min(values) or statistics.stdev(values) < min_std:
        return [0.0] * len(values)
    mean, std = statistics.mean(values), statistics.stdev(values)
    return [(v - mean) / (std + EPS) for v in values]


def _expected_advantages(
    groups: list[Group], alpha: float, min_std: float
) -> dict[tuple[int, int, int], float]:
    """(trajectory, round, position in response) -> advantage, by plain loops."""
    expected = {}
    b = 0
    for group in groups:
        outcome = _normalized([t.reward for t in group.trajectories])
        items = [
            (i, r.index, pm - pf)
            for i, t in enumerate(group.trajectories)
            for r, pm, pf in zip(
                [r for r in t.rounds if r.mem_span], t.p_mem, t.p_full, strict=False
            )
        ]
        memory = dict(
            zip(
                [(i, t) for i, t, _ in items],
                _normalized([x for _, _, x in items], min_std),
                strict=True,
            )
        )
        for i, traj in enumerate(group.trajectories):
            for rnd in traj.rounds:
                for p in range(len(rnd.response_ids)):
                    value = outcome[i]
                    if (
                        rnd.mem_span
                        and rnd.mem_span[0] <= p < rnd.mem_span[1]
                        and (i, rnd.index) in memory
                    ):
                        value += alpha * memory[(i, rnd.index)]
                    expected[(b + i, rnd.index, p)] = value
        b += len(group.trajectories)
    return expected


# The cached groups' pools have P_mem - P_full stds of about 0.36 and 0.57: min_std 0.45
# silences the first and keeps the second.
@pytest.mark.parametrize(("alpha", "min_std"), [(1.0, 0.0), (0.5, 0.0), (1.0, 0.45)])
def test_memory_advantage_lands_only_on_mem_tokens(
    tiny_model_dir: Path, alpha: float, min_std: float
) -> None:
    groups = cached_groups(tiny_model_dir, 2, mode="memory")
    batch = build_batch(groups, alpha=alpha, mem_min_std=min_std)
    expected = _expected_advantages(groups, alpha, min_std)
    trajectories = [t for g in groups for t in g.trajectories]
    seen_memory = 0
    for i, seq in enumerate(batch.sequences):
        (t,) = seq.rounds  # memory mode: one round per sequence
        rnd = trajectories[seq.trajectory].rounds[t]
        start = len(rnd.prompt_ids)
        got = batch.advantages[batch.offsets[i] : batch.offsets[i + 1]].numpy()
        want = [expected[(seq.trajectory, t, p - start)] for p in seq.positions]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        in_mem = batch.in_memory[batch.offsets[i] : batch.offsets[i + 1]].numpy()
        span = rnd.mem_span or (0, 0)
        np.testing.assert_array_equal(
            in_mem, [(span[0] <= p - start < span[1]) for p in seq.positions]
        )
        seen_memory += int(in_mem.sum())
    assert seen_memory > 0  # the test data holds scored memories
    assert batch.stats["mem_token_frac"] == pytest.approx(seen_memory / batch.num_tokens)


@pytest.mark.parametrize(("min_std", "silenced"), [(0.0, 0.0), (0.45, 0.5)])
def test_memory_stats_say_whether_the_memory_term_agrees_with_the_outcome(
    tiny_model_dir: Path, min_std: float, silenced: float
) -> None:
    groups = cached_groups(tiny_model_dir, 2, mode="memory")
    stats = build_batch(groups, mem_min_std=min_std).stats
    assert stats["mem_pool_silenced_frac"] == silenced
    agree, r_m, reward = [], [], []
    for group in groups:
        outcome = _normalized([t.reward for t in group.trajectories])
        items = [
            (i, pm - pf)
            for i, t in enumerate(group.trajectories)
            for pm, pf in zip(t.p_mem, t.p_full, strict=True)
        ]
        memory = _normalized([x for _, x in items], min_std)
        agree += [
            (m > 0) == (outcome[i] > 0)
            for (i, _), m in zip(items, memory, strict=True)
            if m and outcome[i]
        ]
        r_m += [x for _, x in items]
        reward += [group.trajectories[i].reward for i, _ in items]
    if agree:
        assert stats["mem_adv_agreement"] == pytest.approx(sum(agree) / len(agree))
    else:
        assert "mem_adv_agreement" not in stats
    assert stats["mem_reward_outcome_corr"] == pytest.approx(float(np.corrcoef(r_m, reward)[0, 1]))


def test_alpha_zero_is_plain_grpo(tiny_model_dir: Path) -> None:
    groups = cached_groups(tiny_model_dir, 2, mode="memory")
    batch = build_batch(groups, alpha=0.0)
    outcome = [a for g in groups for a in _normalized([t.reward for t in g.trajectories])]
    per_token = np.repeat(
        [outcome[s.trajectory] for s in batch.sequences], [s.num_trained for s in batch.sequences]
    )
    np.testing.assert_allclose(batch.advantages.numpy(), per_token, rtol=1e-6, atol=1e-6)
    unscored = [
        g.model_copy(
            update={
                "trajectories": [
                    t.model_copy(update={"p_mem": [], "p_full": []}) for t in g.trajectories
                ]
            }
        )
        for g in groups
    ]
    assert build_batch(unscored, alpha=1.0).advantages.equal(batch.advantages)


def test_memory_mode_trains_responses_only(tiny_model_dir: Path) -> None:
    groups = cached_groups(tiny_model_dir, 2, mode="memory")
    batch = build_batch(groups)
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(batch.sequences) == sum(len(t.rounds) for t in trajectories)
    for seq in batch.sequences:
        rnd = trajectories[seq.trajectory].rounds[seq.rounds[0]]
        np.testing.assert_array_equal(seq.input_ids, [*rnd.prompt_ids, *rnd.response_ids])
        np.testing.assert_array_equal(
            seq.positions, np.arange(len(rnd.prompt_ids), len(seq.input_ids))
        )
        np.testing.assert_array_equal(seq.rollout_logprobs, rnd.response_logprobs.numpy())


def test_full_mode_masks_prompts_and_information(tiny_model_dir: Path, tokenizer: object) -> None:
    groups = cached_groups(tiny_model_dir, 2, mode="full", k=2)
    batch = build_batch(groups)
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(batch.sequences) == len(trajectories)  # one sequence per trajectory
    multi_round = 0
    for seq in batch.sequences:
        traj = trajectories[seq.trajectory]
        last = traj.rounds[-1]
        np.testing.assert_array_equal(seq.input_ids, [*last.prompt_ids, *last.response_ids])
        trained = np.zeros(len(seq.input_ids), dtype=bool)
        trained[seq.positions] = True
        want = np.zeros_like(trained)
        for rnd in traj.rounds:
            start = len(rnd.prompt_ids)
            want[start : start + len(rnd.response_ids)] = True
            np.testing.assert_array_equal(
                seq.input_ids[start : start + len(rnd.response_ids)], rnd.response_ids
            )
        np.testing.assert_array_equal(trained, want)
        for earlier, later in zip(traj.rounds, traj.rounds[1:], strict=False):
            # the information block sits between a response and the next prompt's end
            info = np.arange(
                len(earlier.prompt_ids) + len(earlier.response_ids), len(later.prompt_ids)
            )
            assert len(info) > 0 and not trained[info].any()
            text = tokenizer.decode(seq.input_ids[info])  # type: ignore[attr-defined]
            assert "<information>" in text
            multi_round += 1
    assert multi_round > 0


def test_full_mode_without_consistent_prefixes_trains_round_by_round(tiny_model_dir: Path) -> None:
    (group,) = cached_groups(tiny_model_dir, 1, mode="full", k=2)
    traj = max(group.trajectories, key=lambda t: len(t.rounds))
    assert len(traj.rounds) > 1
    broken = traj.rounds[1].model_copy(update={"prompt_ids": traj.rounds[1].prompt_ids[5:]})
    odd = Trajectory(rounds=[traj.rounds[0], broken, *traj.rounds[2:]])
    sequences = trajectory_sequences(odd, full_mode=True)
    assert [s.rounds for s in sequences] == [(t,) for t in range(len(odd.rounds))]


def test_validate_group_names_the_bad_token(tiny_model_dir: Path) -> None:
    (group,) = cached_groups(tiny_model_dir, 1)
    assert validate_group(group, 2060) is None
    rnd = group.trajectories[0].rounds[0]
    bad = Round.model_validate({**rnd.model_dump(), "response_ids": [*rnd.response_ids[:-1], 5000]})
    group.trajectories[0].rounds[0] = bad
    reason = validate_group(group, 2060)
    assert reason is not None and "5000" in reason and "response_ids" in reason


def test_empty_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one group"):
        build_batch([])


def test_neg_adv_scale_shrinks_only_negative_advantages(tiny_model_dir: Path) -> None:
    groups = cached_groups(tiny_model_dir, 2, mode="memory")
    plain = build_batch(groups).advantages
    scaled = build_batch(groups, neg_adv_scale=0.2).advantages
    negative = plain < 0
    assert negative.any() and (plain > 0).any()  # the test data holds both signs
    np.testing.assert_array_equal(scaled[~negative].numpy(), plain[~negative].numpy())
    np.testing.assert_allclose(
        scaled[negative].numpy(), 0.2 * plain[negative].numpy(), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("scale", [0.0, -0.1, 1.1])
def test_neg_adv_scale_config_range(scale: float) -> None:
    assert TrainerConfig().neg_adv_scale == 1.0
    with pytest.raises(ValidationError, match="neg_adv_scale"):
        TrainerConfig(neg_adv_scale=scale)
