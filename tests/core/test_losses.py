"""Losses: hand-computed cases for every KL kind, clip side, dual clip and aggregation;
agg_loss against a plain-loop reference of every aggregation mode."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from mempo.losses import (
    AGG_MODES,
    AggMode,
    agg_loss,
    agg_weights,
    entropy_from_logits,
    kl_penalty,
    ppo_policy_loss,
)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


class TestKL:
    def test_k1_k2_abs(self) -> None:
        logp, ref = t(-1.0, -2.0), t(-1.5, -1.0)
        assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
        assert kl_penalty(logp, ref, "kl").tolist() == pytest.approx([0.5, -1.0])
        assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
        assert kl_penalty(logp, ref, "mse").tolist() == pytest.approx([0.125, 0.5])
        assert kl_penalty(logp, ref, "abs").tolist() == pytest.approx([0.5, 1.0])

    def test_k3_values(self) -> None:
        logp, ref = t(-1.0, -2.0), t(-1.5, -1.0)
        # log r = ref - logp = -0.5, 1.0 -> r - log r - 1
        want = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
        assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(want)
        assert kl_penalty(logp, ref, "low_var_kl").tolist() == pytest.approx(want)

    def test_k3_clamps(self) -> None:
        # log r = 30 is clamped to 20 first, then the value (e^20 - 21) to 10
        assert kl_penalty(t(-40.0), t(-10.0), "k3").tolist() == [10.0]
        # log r = -30 -> clamped to -20: e^-20 + 20 - 1 = 19.000..., clamped to 10
        assert kl_penalty(t(-10.0), t(-40.0), "k3").tolist() == [10.0]
        # a moderate gap is not clamped: log r = -5 -> e^-5 + 5 - 1
        assert kl_penalty(t(-1.0), t(-6.0), "k3").item() == pytest.approx(math.exp(-5) + 4)

    def test_unknown_kind(self) -> None:
        with pytest.raises(ValueError, match="unknown KL kind"):
            kl_penalty(t(0.0), t(0.0), "full")  # type: ignore[arg-type]


class TestPPO:
    def test_ratio_one_is_minus_advantage(self) -> None:
        loss, m = ppo_policy_loss(t(-1.0, -2.0), t(-1.0, -2.0), t(2.0, -3.0))
        assert loss.tolist() == pytest.approx([-2.0, 3.0])
        assert m["pg_clipfrac"].item() == 0.0
        assert m["ppo_kl"].item() == 0.0

    def test_upper_clip_positive_advantage(self) -> None:
        # ratio e^0.5 = 1.6487 > 1.2: the clipped term -A*1.2 is larger (less negative)
        loss, m = ppo_policy_loss(t(-0.5), t(-1.0), t(1.0))
        assert loss.item() == pytest.approx(-1.2)
        assert m["pg_clipfrac"].item() == 1.0

    def test_lower_clip_negative_advantage(self) -> None:
        # ratio e^-0.5 = 0.6065 < 0.8, A = -1: max(0.6065, 0.8) = 0.8
        loss, m = ppo_policy_loss(t(-1.5), t(-1.0), t(-1.0))
        assert loss.item() == pytest.approx(0.8)
        assert m["pg_clipfrac"].item() == 1.0
        assert m["pg_clipfrac_lower"].item() == 0.0

    def test_inside_clip_range_unclipped(self) -> None:
        ratio = math.exp(0.1)
        loss, m = ppo_policy_loss(t(-0.9), t(-1.0), t(2.0))
        assert loss.item() == pytest.approx(-2.0 * ratio)
        assert m["pg_clipfrac"].item() == 0.0

    def test_dual_clip_bounds_negative_advantage(self) -> None:
        # ratio e^2 = 7.39, A = -1: clipped loss max(7.39, 1.2) = 7.39 > clip_c * 1 = 3 -> 3
        loss, m = ppo_policy_loss(t(1.0), t(-1.0), t(-1.0), clip_c=3.0)
        assert loss.item() == pytest.approx(3.0)
        assert m["pg_clipfrac_lower"].item() == 1.0

    def test_dual_clip_not_applied_to_positive_advantage(self) -> None:
        # ratio e^2 with A = +1: the upper clip gives -1.2, the dual clip is not involved
        loss, m = ppo_policy_loss(t(1.0), t(-1.0), t(1.0), clip_c=3.0)
        assert loss.item() == pytest.approx(-1.2)
        assert m["pg_clipfrac_lower"].item() == 0.0

    def test_log_ratio_clamped(self) -> None:
        loss, _ = ppo_policy_loss(t(0.0), t(-100.0), t(-1.0), clip_c=1e30)
        assert loss.item() == pytest.approx(math.exp(20.0))

    def test_metrics_respect_mask(self) -> None:
        _, m = ppo_policy_loss(t(-0.5, -1.0), t(-1.0, -1.0), t(1.0, 1.0), mask=t(0.0, 1.0))
        assert m["pg_clipfrac"].item() == 0.0  # only the unclipped token counts

    def test_clip_c_must_exceed_one(self) -> None:
        with pytest.raises(ValueError):
            ppo_policy_loss(t(0.0), t(0.0), t(1.0), clip_c=1.0)

    def test_gradients_reach_only_logp(self) -> None:
        logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
        old = torch.tensor([-1.1, -1.9, -0.5], requires_grad=True)
        ref = torch.tensor([-1.2, -2.1, -0.4], requires_grad=True)
        adv = torch.tensor([1.0, -1.0, 0.5], requires_grad=True)
        loss, _ = ppo_policy_loss(logp, old.detach(), adv.detach())
        total = agg_loss(loss + 0.001 * kl_penalty(logp, ref.detach(), "k3"), torch.ones(3))
        total.backward()
        assert logp.grad is not None and logp.grad.abs().sum() > 0
        assert old.grad is None and ref.grad is None and adv.grad is None


class TestAgg:
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])

    def test_token_mean(self) -> None:
        assert agg_loss(self.per_token, self.mask, "token-mean").item() == pytest.approx(7 / 3)

    def test_seq_mean_token_mean(self) -> None:
        assert agg_loss(self.per_token, self.mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)

    def test_seq_mean_token_sum(self) -> None:
        assert agg_loss(self.per_token, self.mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)

    def test_traj_mean_token_mean(self) -> None:
        # rows 0 and 2 are rounds of trajectory 0, row 1 is trajectory 1
        per_token = torch.tensor([[1.0, 2.0], [10.0, 0.0], [3.0, 6.0]])
        mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
        traj = torch.tensor([0, 1, 0])[:, None].expand(3, 2)
        got = agg_loss(per_token, mask, "traj-mean-token-mean", traj_ids=traj)
        assert got.item() == pytest.approx(((1 + 2 + 3) / 3 + 10) / 2)

    def test_packed_equals_padded(self) -> None:
        flat_values = torch.tensor([1.0, 2.0, 4.0])
        seq = torch.tensor([0, 0, 1])
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
            packed = agg_loss(flat_values, torch.ones(3), mode, seq_ids=seq)  # type: ignore[arg-type]
            padded = agg_loss(self.per_token, self.mask, mode)  # type: ignore[arg-type]
            assert packed.item() == pytest.approx(padded.item()), mode

    def test_whole_batch_weights_make_micro_batches_add_up(self) -> None:
        traj = torch.tensor([0, 0])[:, None].expand(2, 3)
        for mode in AGG_MODES:
            whole = agg_loss(self.per_token, self.mask, mode, traj_ids=traj)
            weights = agg_weights(self.mask, mode, traj_ids=traj)
            parts = [(self.per_token[i] * weights[i]).sum() for i in range(2)]
            assert sum(p.item() for p in parts) == pytest.approx(whole.item()), mode
        tokens = agg_weights(self.mask, "token-mean")
        assert tokens.reshape(-1).tolist() == pytest.approx([1 / 3, 1 / 3, 0, 1 / 3, 0, 0])

    def test_empty_sequences_are_ignored(self) -> None:
        mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
        assert agg_loss(self.per_token, mask, "seq-mean-token-mean").item() == pytest.approx(1.5)

    def test_errors(self) -> None:
        with pytest.raises(ValueError, match="traj_ids"):
            agg_loss(self.per_token, self.mask, "traj-mean-token-mean")
        with pytest.raises(ValueError, match="unknown loss aggregation"):
            agg_loss(self.per_token, self.mask, "sum")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="seq_ids"):
            agg_loss(torch.ones(3), torch.ones(3), "seq-mean-token-mean")


def agg_reference(values: list[float], keep: list[bool], units: list[int], mode: AggMode) -> float:
    """A mode by plain loops over the kept tokens: group by unit (sequence or trajectory),
    reduce each unit (mean or sum), then average the units; token-mean ignores units."""
    kept = [(v, u) for v, k, u in zip(values, keep, units, strict=True) if k]
    if mode == "token-mean":
        return sum(v for v, _ in kept) / max(len(kept), 1)
    groups: dict[int, list[float]] = defaultdict(list)
    for v, u in kept:
        groups[u].append(v)
    per_unit = [
        sum(g) if mode == "seq-mean-token-sum" else sum(g) / len(g) for g in groups.values()
    ]
    return sum(per_unit) / max(len(per_unit), 1)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_its_plain_loop_reference(mode: AggMode) -> None:
    generator = torch.Generator().manual_seed(7)
    for _ in range(20):
        n, width = 6, 9
        per_token = torch.randn(n, width, generator=generator, dtype=torch.float64)
        lengths = torch.randint(0, width + 1, (n,), generator=generator)  # some rows empty
        mask = torch.arange(width)[None, :] < lengths[:, None]  # (n, width)
        seq = torch.arange(n)[:, None].expand(n, width)
        traj = torch.randint(0, 3, (n,), generator=generator)[:, None].expand(n, width)
        units = (traj if mode == "traj-mean-token-mean" else seq).reshape(-1).tolist()
        want = agg_reference(per_token.reshape(-1).tolist(), mask.reshape(-1).tolist(), units, mode)
        got = agg_loss(per_token, mask, mode, traj_ids=traj)
        assert got.item() == pytest.approx(want, rel=1e-12, abs=1e-12)
        ones = torch.ones(int(mask.sum()), dtype=torch.float64)
        packed = agg_loss(per_token[mask], ones, mode, seq[mask], traj[mask])
        assert packed.item() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_entropy_of_uniform() -> None:
    logits = torch.zeros(2, 4)
    assert entropy_from_logits(logits).tolist() == pytest.approx([math.log(4)] * 2)
