"""The CPU engine's pure parts: per-row sampling against plain-loop references, and the
continuous-batching tensors (merge, drop, trim) against a plain forward pass."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from services.rollout.engine.batch import RunningBatch, prompt_logprobs
from services.rollout.engine.model import ModelRunner
from services.rollout.engine.sampling import RowParams, SamplingRows, filter_logits, sample_next
from tests.services.rollout.test_engine_support import teacher_forced


def reference_filter(row: list[float], top_p: float, top_k: int) -> list[float]:
    """Plain loop: keep the top_k best, then the smallest prefix whose mass reaches top_p."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    total = sum(math.exp(v) for v in row)
    kept, mass = [], 0.0
    for rank, i in enumerate(order):
        if rank >= top_k or mass > top_p:
            break
        kept.append(i)
        mass += math.exp(row[i]) / total
    return [v if i in kept else -math.inf for i, v in enumerate(row)]


@pytest.mark.parametrize("seed", range(4))
def test_filter_logits_matches_a_plain_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 40, generator=gen, dtype=torch.float64) * 2
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.1, 1.0, 0.7], dtype=torch.float64)
    top_k = torch.tensor([40, 40, 40, 5, 3, 1])
    got = filter_logits(logits, top_p, top_k)
    for r in range(6):
        want = reference_filter(logits[r].tolist(), float(top_p[r]), int(top_k[r]))
        assert got[r].tolist() == want


def test_logprobs_are_of_the_temperature_scaled_distribution() -> None:
    """SGLang's semantics: log_softmax(logits / T) before top-p / top-k; T = 1 on greedy rows."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [RowParams(0.0), RowParams(2.0), RowParams(0.0), RowParams(0.6, top_p=0.5, top_k=3)]
    rows = SamplingRows.build(params, 50)
    tokens, chosen = sample_next(logits, rows, torch.Generator().manual_seed(1))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    temperature = torch.tensor([1.0, 2.0, 1.0, 0.6])[:, None]
    want = torch.log_softmax(logits / temperature, -1)[torch.arange(4), tokens]
    assert torch.allclose(chosen, want, atol=1e-6)
    assert not torch.allclose(chosen[1], torch.log_softmax(logits, -1)[1, tokens[1]])


def test_inverse_cdf_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]]).repeat(20000, 1)
    rows = SamplingRows.build([RowParams(1.0)] * 20000, 5)
    tokens, _ = sample_next(logits, rows, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=5).double() / 20000
    assert torch.allclose(freq, logits[0].double().softmax(-1), atol=0.01)

    hot = SamplingRows.build([RowParams(0.5, top_k=2)] * 20000, 5)
    tokens, _ = sample_next(logits, hot, torch.Generator().manual_seed(0))
    expected = (logits[0, :2] / 0.5).double().softmax(-1)
    assert set(tokens.tolist()) <= {0, 1}
    assert abs(float((tokens == 0).double().mean()) - float(expected[0])) < 0.01


def test_a_seeded_row_does_not_depend_on_its_batch() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))

    def seeded_draws(others: list[RowParams]) -> list[int]:
        mine = torch.Generator().manual_seed(42)
        rows = SamplingRows.build([*others, RowParams(1.0, generator=mine)], 100)
        draws = []
        for _ in range(20):
            batch = torch.cat([logits[1 : len(others) + 1], logits[:1]])  # mine last
            tokens, _ = sample_next(batch, rows, torch.Generator())
            draws.append(int(tokens[-1]))
        return draws

    assert seeded_draws([]) == seeded_draws([RowParams(1.0), RowParams(0.0), RowParams(0.7)])


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    return ModelRunner.load(tiny_model_dir)


def test_merged_and_trimmed_batches_match_plain_forwards(runner: ModelRunner) -> None:
    """Rows join mid-generation (shorter and longer than the batch), the longest row
    leaves (its pad columns are trimmed): every logit still equals a plain forward."""
    groups = [[[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22]], [list(range(30, 45)), [50]]]
    seqs: list[list[int]] = []
    logprobs: list[list[float]] = []

    def record(batch_rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        tokens = logits.argmax(-1)  # (B,)
        lp = torch.log_softmax(logits, -1)
        for row, r in enumerate(batch_rows):
            seqs[r].append(int(tokens[row]))
            logprobs[r].append(float(lp[row, tokens[row]]))
        return tokens

    with torch.inference_mode():
        batch, logits = RunningBatch.prefill(runner, groups[0])
        seqs += [list(p) for p in groups[0]]
        logprobs += [[], []]
        batch.last = record([0, 1], logits[:, -1])
        for _ in range(3):
            batch.last = record([0, 1], batch.decode(runner))
        joining, logits = RunningBatch.prefill(runner, groups[1])
        seqs += [list(p) for p in groups[1]]
        logprobs += [[], []]
        joining.last = record([2, 3], logits[:, -1])
        batch.merge(joining)
        for _ in range(4):
            batch.last = record([0, 1, 2, 3], batch.decode(runner))
        width = batch.mask.shape[1]
        batch.select([0, 1, 3])  # the 15-token prompt leaves
        assert batch.mask.shape[1] < width  # its padding went with it
        for _ in range(4):
            batch.last = record([0, 1, 3], batch.decode(runner))

    prompts = [*groups[0], *groups[1]]
    for r, prompt in enumerate(prompts):
        reference = teacher_forced(runner.model, seqs[r])[len(prompt) - 1 :]
        assert torch.allclose(torch.tensor(logprobs[r]), torch.tensor(reference), atol=1e-4)


def test_prompt_logprobs_alignment(runner: ModelRunner) -> None:
    prompt = [7, 8, 9, 10, 11, 12]
    with torch.inference_mode():
        _, logits = RunningBatch.prefill(runner, [[3, 4, 5, 6, 7, 8, 9, 10, 11], prompt], keep=5)
    got: Any = prompt_logprobs(logits[1], prompt, start=2)  # positions 2..5
    reference = teacher_forced(runner.model, prompt)
    assert got[0] is None and len(got) == 4
    assert torch.allclose(torch.tensor(got[1:]), torch.tensor(reference[2:]), atol=1e-4)
