"""The tensors of the sequences being decoded together: KV cache, mask, last tokens.

Glossary: ``B`` rows, ``L`` cached positions, ``H`` KV heads, ``D`` head size, ``V`` vocab.

Rows are left-padded to a common length ``L``; each row's RoPE positions count only its
own tokens, so rows of different lengths (and rows that joined later) share one forward
pass. Continuous batching: a freshly prefilled group is merged into the running batch
by left-padding the shorter side; finished rows are dropped, and pad columns that no
row needs any more are trimmed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from services.rollout.engine.model import ModelRunner


def prompt_logprobs(logits: torch.Tensor, prompt: Sequence[int], start: int) -> list[float | None]:
    """SGLang's input_token_logprobs from one row's prefill logits (keep, V), those of its
    last ``keep`` positions: entry j is log p(prompt[start + j] | prompt[:start + j]) for
    j >= 1, and entry 0 is None. Needs keep >= len(prompt) - start."""
    keep = logits.shape[0]
    first = keep - (len(prompt) - start)  # the row of position ``start``
    logprobs = logits[first : keep - 1].float().log_softmax(-1)  # (P - start - 1, V)
    targets = torch.tensor(list(prompt[start + 1 :]), dtype=torch.long)
    return [None, *logprobs.gather(-1, targets[:, None])[:, 0].tolist()]


def _layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError("this transformers version's cache has no .layers (needs >= 4.56)")
    return list(layers)


class RunningBatch:
    def __init__(self, cache: Any, mask: torch.Tensor, last: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask  # (B, L) long, 0 on left padding
        self.last = last  # (B,) the token each row feeds to the next step

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @classmethod
    def prefill(
        cls, runner: ModelRunner, prompts: Sequence[Sequence[int]], keep: int = 1
    ) -> tuple[RunningBatch, torch.Tensor]:
        """Run the prompts; logits of the last ``keep`` padded positions, (B, keep, V).

        ``last`` is unset (the caller samples it from the logits)."""
        length = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), length, dtype=torch.long)  # (B, L)
        mask = torch.zeros(len(prompts), length, dtype=torch.long)  # (B, L)
        for row, prompt in enumerate(prompts):
            ids[row, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, length - len(prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
        cache = runner.new_cache()
        logits = runner.forward(ids, mask, positions, cache, keep=min(keep, length))
        return cls(cache, mask, torch.zeros(len(prompts), dtype=torch.long)), logits

    def decode(self, runner: ModelRunner) -> torch.Tensor:
        """One step for every row: feed ``last``, return next-token logits (B, V)."""
        self.mask = F.pad(self.mask, (0, 1), value=1)  # (B, L + 1)
        positions = self.mask.sum(-1, keepdim=True) - 1  # (B, 1)
        logits = runner.forward(self.last[:, None], self.mask, positions, self.cache)
        return logits[:, -1]

    def _pad_left(self, columns: int) -> None:
        if columns <= 0:
            return
        for layer in _layers(self.cache):
            layer.keys = F.pad(layer.keys, (0, 0, columns, 0))  # (B, H, L + c, D)
            layer.values = F.pad(layer.values, (0, 0, columns, 0))
        self.mask = F.pad(self.mask, (columns, 0))

    def merge(self, other: RunningBatch) -> None:
        """Append ``other``'s rows (in place); ``other`` must not be used afterwards."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        self._pad_left(length - self.mask.shape[1])
        other._pad_left(length - other.mask.shape[1])
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True):
            mine.keys = torch.cat([mine.keys, theirs.keys])  # (B1 + B2, H, L, D)
            mine.values = torch.cat([mine.values, theirs.values])
        self.mask = torch.cat([self.mask, other.mask])
        self.last = torch.cat([self.last, other.last])

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in order), then drop pad columns no row uses."""
        index = torch.tensor(list(rows), dtype=torch.long)
        self.mask = self.mask[index]
        self.last = self.last[index]
        unused = int((self.mask.sum(0) == 0).long().cumprod(0).sum())  # leading all-pad columns
        for layer in _layers(self.cache):
            layer.keys = layer.keys[index, :, unused:]  # (B', H, L - unused, D)
            layer.values = layer.values[index, :, unused:]
        self.mask = self.mask[:, unused:]
