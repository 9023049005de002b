"""One training step on the tiny model (services/learner/step.py): ``train_step``, its PPO
updates over mini- and micro-batches, the losses and the skipped non-finite step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mempo.schemas import Round
from services.learner.batch import TrainingBatch
from services.learner.ppo import span_mean_weights
from services.learner.step import make_batch, train_step
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from tests.services.learner.factories import cached_groups


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }


def test_one_step_changes_the_policy_and_never_the_reference(tiny_model_dir: Path) -> None:
    groups = cached_groups(tiny_model_dir, 2)
    trainer = Trainer(TrainerConfig(lr=1e-3, warmup_steps=4), tiny_model_dir)
    assert trainer.ref is not None
    before, ref_before = snapshot(trainer.policy), snapshot(trainer.ref)
    metrics = train_step(trainer, groups)
    after = snapshot(trainer.policy)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(changed) == len(before)  # every parameter tensor moved
    assert all(not p.requires_grad and p.grad is None for p in trainer.ref.parameters())
    assert all(torch.equal(ref_before[n], p) for n, p in trainer.ref.named_parameters())
    assert not trainer.ref.training
    assert (trainer.step, trainer.version, trainer.optimizer_steps) == (1, 1, 2)
    assert metrics["lr"] == pytest.approx(1e-3 * 2 / 4)  # two optimizer steps into the warmup
    assert metrics["optimizer_steps"] == 2 and metrics["tokens"] > 0
    for name in ("loss", "pg_clipfrac", "ppo_kl", "kl", "entropy", "grad_norm", "tokens_per_s"):
        assert torch.isfinite(torch.tensor(metrics[name])), name


def test_first_minibatch_has_ratio_one_with_recomputed_old_logprobs(tiny_model_dir: Path) -> None:
    groups = cached_groups(tiny_model_dir, 2)
    trainer = Trainer(
        TrainerConfig(lr=3e-3, warmup_steps=0, mini_batches=2, ppo_epochs=2), tiny_model_dir
    )
    metrics = train_step(trainer, groups)
    first, *later = trainer.minibatch_metrics
    assert len(later) == 3
    assert first["pg_clipfrac"] == 0.0 and first["pg_clipfrac_lower"] == 0.0
    assert abs(first["ppo_kl"]) < 1e-6
    assert first["kl"] < 1e-9  # the reference is the initial policy
    assert max(abs(m["ppo_kl"]) for m in later) > 1e-4  # the policy moved after the first step
    # the groups' log-probs are the tiny model's own: no rollout/trainer gap
    assert metrics["logprob_gap"] < 1e-4


def test_a_single_update_per_step_uses_its_own_forward_as_old_logprobs(
    tiny_model_dir: Path,
) -> None:
    groups = cached_groups(tiny_model_dir, 2, logprob_noise=0.3)
    trainer = Trainer(TrainerConfig(mini_batches=1, beta_kl=0.0), tiny_model_dir)
    metrics = train_step(trainer, groups)
    assert metrics["ppo_kl"] == 0.0 and metrics["pg_clipfrac"] == 0.0  # ratio exactly 1
    assert 0.05 < metrics["logprob_gap"] < 1.0  # the gap to the rollout is still measured


def test_rollout_logprobs_as_old_report_the_gap(tiny_model_dir: Path) -> None:
    groups = cached_groups(tiny_model_dir, 2, logprob_noise=0.3)
    trainer = Trainer(TrainerConfig(recompute_old_logprobs=False, beta_kl=0.0), tiny_model_dir)
    assert trainer.ref is None  # beta 0: no reference model at all
    metrics = train_step(trainer, groups)
    assert 0.05 < metrics["logprob_gap"] < 1.0
    assert abs(trainer.minibatch_metrics[0]["ppo_kl"]) > 1e-3  # old = the rollout's, not ours
    assert metrics["kl"] == 0.0


@pytest.mark.parametrize(
    ("loss_agg", "mem_loss"),
    [
        ("token-mean", "shared"),
        ("seq-mean-token-mean", "shared"),
        ("seq-mean-token-sum", "shared"),
        ("traj-mean-token-mean", "shared"),
        ("token-mean", "span-mean"),
    ],
)
def test_micro_batches_add_up_to_the_mini_batch(
    tiny_model_dir: Path, loss_agg: str, mem_loss: str
) -> None:
    groups = cached_groups(tiny_model_dir, 2)
    result = []
    for budget, rows in ((16384, None), (600, 300)):  # one micro-batch, then many with several rows
        config = TrainerConfig(
            loss_agg=loss_agg,
            mem_loss=mem_loss,  # type: ignore[arg-type]
            mini_batches=1,
            micro_batch_tokens=budget,
            row_tokens=rows,
            beta_kl=0.01,
        )
        trainer = Trainer(config, tiny_model_dir)
        metrics = train_step(trainer, groups)
        result.append((metrics, grads(trainer.policy)))
    (one, g_one), (many, g_many) = result
    assert one["loss"] == pytest.approx(many["loss"], rel=1e-5, abs=1e-7)
    assert g_one.keys() == g_many.keys()
    for name, g in g_one.items():
        torch.testing.assert_close(g_many[name], g, rtol=1e-4, atol=1e-7)


def span_mean_reference(batch: TrainingBatch) -> float:
    """FoldAct's separated loss with the ratio at 1 (loss per token -A), by plain loops over
    the sequences' <mem> spans (absolute positions), independent of mem_span_ids."""
    outside, spans = [], []
    for i, seq in enumerate(batch.sequences):
        adv = batch.advantages[batch.offsets[i] : batch.offsets[i + 1]].tolist()
        covered = set()
        for start, end, _ in seq.spans:
            members = [j for j, pos in enumerate(seq.positions) if start <= pos < end]
            covered.update(members)
            spans.append([-adv[j] for j in members])
        outside += [-a for j, a in enumerate(adv) if j not in covered]
    spans = [span for span in spans if span]
    return sum(outside) / len(outside) + sum(sum(s) / len(s) for s in spans) / len(spans)


def test_span_mean_matches_its_reference_and_weighs_the_summary_up(tiny_model_dir: Path) -> None:
    groups = cached_groups(tiny_model_dir, 2)
    losses, batches = {}, {}
    for mem_loss in ("shared", "span-mean"):
        config = TrainerConfig(mem_loss=mem_loss, mini_batches=1, ppo_epochs=1, beta_kl=0.0)  # type: ignore[arg-type]
        trainer = Trainer(config, tiny_model_dir)
        batches[mem_loss] = make_batch(groups, config, trainer.vocab_size)
        losses[mem_loss] = train_step(trainer, groups)["loss"]  # one update: ratio 1, loss -A
    batch = batches["span-mean"]
    assert int(batch.mem_span_ids.max()) + 1 == sum(len(s.spans) for s in batch.sequences) > 0
    assert losses["span-mean"] == pytest.approx(span_mean_reference(batch), rel=1e-5, abs=1e-7)
    assert losses["shared"] == pytest.approx(-float(batch.advantages.mean()), rel=1e-5, abs=1e-7)
    # the summary's share of the loss weight: its token share under shared, half under span-mean
    weights = span_mean_weights(batch, batch.token_index(range(len(batch.sequences))))
    inside = batch.mem_span_ids >= 0
    assert float(weights[inside].sum()) == pytest.approx(1.0) == float(weights[~inside].sum())
    assert float(inside.float().mean()) < 0.5


def test_entropy_bonus_changes_the_gradient(tiny_model_dir: Path) -> None:
    groups = cached_groups(tiny_model_dir, 1)
    results = []
    for coef in (0.0, 0.1):
        trainer = Trainer(
            TrainerConfig(entropy_coef=coef, mini_batches=1, beta_kl=0.0), tiny_model_dir
        )
        metrics = train_step(trainer, groups)
        results.append((metrics, grads(trainer.policy)))
    (plain, g0), (bonus, g1) = results
    assert plain["entropy"] == pytest.approx(bonus["entropy"], rel=1e-6)  # same weights, same data
    assert bonus["loss"] == pytest.approx(plain["loss"] - 0.1 * plain["entropy"], rel=1e-4)
    assert any(not torch.allclose(g0[n], g1[n]) for n in g0)


def test_a_group_outside_the_vocabulary_is_refused(tiny_model_dir: Path) -> None:
    (group,) = cached_groups(tiny_model_dir, 1)
    rnd = group.trajectories[0].rounds[0]
    group.trajectories[0].rounds[0] = Round.model_validate(
        {**rnd.model_dump(), "prompt_ids": [99999]}
    )
    trainer = Trainer(TrainerConfig(beta_kl=0.0), tiny_model_dir)
    before = snapshot(trainer.policy)
    with pytest.raises(ValueError, match="99999"):
        train_step(trainer, [group])
    assert trainer.version == 0
    assert all(torch.equal(before[n], p) for n, p in trainer.policy.named_parameters())


def test_a_non_finite_loss_skips_the_step_and_is_counted(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A NaN that got past every check (assigned here, past validation) must not reach the
    weights: the optimizer step is skipped, gradients zeroed, the skip counted and logged."""
    groups = cached_groups(tiny_model_dir, 2)
    groups[0].trajectories[0].reward = float("nan")  # NaN advantages -> NaN loss
    trainer = Trainer(TrainerConfig(lr=1e-2, warmup_steps=0, mini_batches=2), tiny_model_dir)
    before = snapshot(trainer.policy)
    with caplog.at_level("WARNING", logger="services.learner.trainer"):
        metrics = train_step(trainer, groups)
    assert "optimizer step skipped" in caplog.text
    assert metrics["skipped_steps"] == 2 and metrics["optimizer_steps"] == 0
    assert trainer.skipped_steps == 2 and trainer.optimizer_steps == 0
    assert all(torch.equal(before[n], p) for n, p in trainer.policy.named_parameters())
    assert all(p.grad is None for p in trainer.policy.parameters())
    assert not trainer.optimizer.state  # AdamW's moments never saw the NaN
    metrics = train_step(trainer, cached_groups(tiny_model_dir, 2))  # good data trains again
    assert metrics["skipped_steps"] == 0 and metrics["optimizer_steps"] == 2
    after = snapshot(trainer.policy)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all(bool(torch.isfinite(p).all()) for p in after.values())
