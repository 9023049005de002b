"""Sequence packing (services/learner/packing.py): layouts, and packed == padded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.learner.batch import build_batch
from services.learner.packing import (
    dummy_micro_batch,
    forward_logprobs,
    micro_batches,
    plan_padded,
    plan_rows,
)
from tests.services.learner.factories import cached_groups


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=40),
    budget=st.integers(64, 1200),
    row=st.one_of(st.none(), st.integers(16, 400)),
)
def test_plan_rows_places_every_sequence_once_within_the_budgets(
    lengths: list[int], budget: int, row: int | None
) -> None:
    row = None if row is None else min(row, budget)
    plan = plan_rows(lengths, budget, row)
    placed = sorted(i for micro in plan for r in micro for i in r)
    assert placed == list(range(len(lengths)))
    for micro in plan:
        widths = [sum(lengths[i] for i in r) for r in micro]
        for r, width in zip(micro, widths, strict=True):
            assert width <= (row or budget) or len(r) == 1  # only a lone long sequence overflows
        assert len(micro) * max(widths) <= budget or len(micro) == 1
    for micro in plan_padded(lengths, budget):
        assert all(len(r) == 1 for r in micro)
        assert len(micro) * max(lengths[r[0]] for r in micro) <= budget or len(micro) == 1


def _loss_and_grads(
    model: torch.nn.Module, batch, budget: int, row_tokens: int | None, packed: bool
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A non-linear per-token loss (token-mean), accumulated over the layout's micro-batches."""
    model.zero_grad(set_to_none=True)
    logp_all = torch.zeros(batch.num_tokens)
    total = torch.zeros(())
    for micro in micro_batches(
        batch, list(range(len(batch.sequences))), budget, row_tokens, packed
    ):
        logp, logits = forward_logprobs(model, micro)
        adv = batch.advantages[micro.token_index]
        loss = (
            -(adv * logp) + 0.1 * logp.square() + 0.01 * logits.logsumexp(-1)
        ).sum() / batch.num_tokens
        loss.backward()
        total += loss.detach()
        logp_all[micro.token_index] = logp.detach()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, logp_all, grads


@pytest.mark.parametrize("mode", ["memory", "full"])
def test_packed_and_padded_give_the_same_loss_and_gradients(
    tiny_model_dir: Path, mode: str
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = build_batch(cached_groups(tiny_model_dir, 2, mode=mode, k=2))
    longest = max(len(s.input_ids) for s in batch.sequences)
    layouts = {
        "alone": (1, None, False),  # every sequence on its own: the ground truth
        "padded": (4 * longest, None, False),
        "one row": (16384, None, True),
        "rows": (3 * longest, longest, True),
    }
    results = {name: _loss_and_grads(model, batch, *layout) for name, layout in layouts.items()}
    ref_loss, ref_logp, ref_grads = results.pop("alone")
    for name, (loss, logp, grads) in results.items():
        torch.testing.assert_close(logp, ref_logp, rtol=0, atol=2e-5, msg=name)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7, msg=name)
        assert grads.keys() == ref_grads.keys()
        for param, g in grads.items():
            torch.testing.assert_close(
                g, ref_grads[param], rtol=1e-4, atol=1e-6, msg=f"{name} {param}"
            )


def test_packed_micro_batches_hold_no_padding_between_sequences(tiny_model_dir: Path) -> None:
    batch = build_batch(cached_groups(tiny_model_dir, 2))
    seqs = list(range(len(batch.sequences)))
    micros = micro_batches(batch, seqs, budget=4096, row_tokens=1024)
    assert sorted(i for m in micros for i in m.sequences) == seqs
    for micro in micros:
        rows, width = micro.input_ids.shape
        assert rows * width <= 4096
        assert int(micro.keep.sum()) == micro.targets.numel() == micro.token_index.numel()
        # every sequence starts a block at position 0; a row's padding adds at most one
        starts = int((micro.position_ids == 0).sum())
        assert len(micro.sequences) <= starts <= len(micro.sequences) + rows
        assert micro.num_tokens == sum(len(batch.sequences[i].input_ids) for i in micro.sequences)
        torch.testing.assert_close(
            micro.targets,
            torch.cat(
                [
                    torch.from_numpy(batch.sequences[i].input_ids[batch.sequences[i].positions])
                    for i in micro.sequences
                ]
            ),
        )


def test_a_dummy_micro_batch_runs_forward_and_backward(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    logp, logits = forward_logprobs(model, dummy_micro_batch())
    (logits.sum() * 0.0).backward()
    assert logp.shape == (1,)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
