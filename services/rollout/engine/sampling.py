"""Per-row sampling of the next token for a batch (pure tensor code).

Glossary: ``B`` rows of the batch, ``V`` vocabulary.

The log-prob returned for a token is ``log_softmax(logits / T)``: of the distribution
sampled from, before top-p / top-k filtering, as SGLang reports it (``layers/sampler.py``,
unless ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``). The learner recomputes the same quantity
with the temperature the Group carries. Temperature 0 (below 1e-5, as SGLang) is greedy;
a greedy row's log-prob is at T = 1, as SGLang (it samples greedy rows with T = 1, top-k 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class RowParams:
    """One row's sampling parameters."""

    temperature: float
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    generator: torch.Generator | None = None  # None: the engine's shared generator


@dataclass(frozen=True)
class SamplingRows:
    """The parameters of every row as tensors, built once per batch composition."""

    temperature: torch.Tensor  # (B,) float, 1.0 on greedy rows
    top_p: torch.Tensor  # (B,) float
    top_k: torch.Tensor  # (B,) long, V where off
    greedy: torch.Tensor  # (B,) bool
    seeded: tuple[tuple[int, torch.Generator], ...]  # sampled rows with their own generator
    all_greedy: bool
    any_greedy: bool
    any_shared: bool  # some sampled row uses the shared generator
    filtered: bool  # some sampled row uses top-p or top-k

    @classmethod
    def build(cls, rows: Sequence[RowParams], vocab_size: int) -> SamplingRows:
        greedy = [r.temperature < GREEDY_BELOW for r in rows]
        top_k = [r.top_k if 0 < r.top_k < vocab_size else vocab_size for r in rows]
        return cls(
            temperature=torch.tensor(
                [1.0 if g else r.temperature for r, g in zip(rows, greedy, strict=True)]
            ),
            top_p=torch.tensor([r.top_p for r in rows]),
            top_k=torch.tensor(top_k, dtype=torch.long),
            greedy=torch.tensor(greedy, dtype=torch.bool),
            seeded=tuple(
                (i, r.generator)
                for i, (r, g) in enumerate(zip(rows, greedy, strict=True))
                if r.generator is not None and not g
            ),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_shared=any(
                r.generator is None and not g for r, g in zip(rows, greedy, strict=True)
            ),
            filtered=any(
                not g and (r.top_p < 1.0 or k < vocab_size)
                for r, g, k in zip(rows, greedy, top_k, strict=True)
            ),
        )


def filter_logits(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Logits with -inf outside each row's top-k and top-p nucleus; (B, V) -> (B, V)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(logits.shape[-1], device=logits.device)  # (V,)
    drop = ranks[None, :] >= top_k[:, None]  # (B, V)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V) mass of the better tokens
    drop |= mass_before > top_p[:, None]  # the first token is always kept
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_next(
    logits: torch.Tensor, rows: SamplingRows, shared: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-prob per row: (B, V) logits -> ((B,) long, (B,) float).

    Sampling inverts each row's CDF at one uniform draw (B random numbers per step, where
    torch.multinomial draws B x V); a row with its own generator draws from it, so its
    sample does not depend on the rest of the batch."""
    logits = logits.float()
    scaled = logits / rows.temperature[:, None]  # (B, V), T = 1 on greedy rows
    logprobs = torch.log_softmax(scaled, dim=-1)  # (B, V) of the sampled distribution
    tokens = logits.argmax(dim=-1) if rows.any_greedy else None  # (B,)
    if not rows.all_greedy:
        if rows.filtered:
            scaled = filter_logits(scaled, rows.top_p, rows.top_k)
        cdf = scaled.softmax(dim=-1).cumsum(dim=-1)  # (B, V)
        uniform = (
            torch.rand(logits.shape[0], generator=shared)
            if rows.any_shared
            else torch.zeros(logits.shape[0])
        )
        for i, generator in rows.seeded:
            uniform[i] = torch.rand(1, generator=generator)[0]
        targets = uniform[:, None] * cdf[:, -1:]  # (B, 1)
        sampled = torch.searchsorted(cdf, targets, right=True)[:, 0].clamp_(
            max=logits.shape[-1] - 1
        )
        tokens = sampled if tokens is None else torch.where(rows.greedy, tokens, sampled)
    assert tokens is not None
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]  # (B,)
    return tokens, chosen
