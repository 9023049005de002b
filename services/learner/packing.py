"""Micro-batches: sequences packed without padding, or padded (the reference layout).

Packed: sequences lie end to end in rows of at most ``row_tokens``; position ids restart
at 0 for every sequence. With no attention mask, transformers turns restarting position
ids into a block-diagonal causal mask (sdpa / eager, ``masking_utils.
find_packed_sequence_indices``) or into varlen attention (flash-attention), so no token
sees another sequence. The rows of a micro-batch are right-padded to the longest row;
the padding gets positions of its own (a block of its own), comes after every real token
so none attends to it, and is never trained.

Padded: one sequence per row and a 2-D attention mask, the layout the packed one must
reproduce exactly (tests/services/learner/test_packing.py).

Logits are computed only where they predict a trained token (``logits_to_keep``), so a
long prompt costs its forward pass but not its vocabulary projection.

Glossary: R rows, C columns (the longest row), K trained tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from services.learner.batch import TrainingBatch
from services.learner.distributed import DistContext, all_reduce_max, split_across_ranks
from services.learner.trainer_config import TrainerConfig


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward worth of sequences."""

    input_ids: Tensor  # (R, C) int64
    position_ids: Tensor  # (R, C) int64, restarting per sequence
    attention_mask: Tensor | None  # (R, C) padded layout only
    keep: Tensor  # (R, C) bool: the logits here predict a trained token
    targets: Tensor  # (K,) the trained tokens, row-major
    temperature: Tensor  # (K,) float32: the T of each trained token's log-prob (its Group's)
    token_index: Tensor  # (K,) their indices in the batch's trained-token space
    sequences: tuple[int, ...]
    num_tokens: int  # real (non-padding) tokens
    dummy: bool = False  # a stand-in forward for a rank without work (collectives must match)

    def to(self, device: torch.device | str) -> MicroBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device, non_blocking=True),
            position_ids=self.position_ids.to(device, non_blocking=True),
            attention_mask=None
            if self.attention_mask is None
            else self.attention_mask.to(device, non_blocking=True),
            keep=self.keep.to(device, non_blocking=True),
            targets=self.targets.to(device, non_blocking=True),
            temperature=self.temperature.to(device, non_blocking=True),
            token_index=self.token_index.to(device, non_blocking=True),
        )


def plan_rows(lengths: Sequence[int], budget: int, row_tokens: int | None) -> list[list[list[int]]]:
    """Sequence indices -> micro-batches -> rows, first-fit decreasing.

    Rows hold at most ``row_tokens`` (or ``budget``) tokens; a micro-batch holds rows
    while rows x longest row stays within ``budget``. A sequence longer than a row gets a
    row of its own, and a row over the budget a micro-batch of its own.
    """
    capacity = row_tokens or budget
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for r, used in enumerate(fill):
            if used + lengths[i] <= capacity:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    micro: list[list[list[int]]] = []
    widest = 0
    for r in sorted(range(len(rows)), key=lambda j: (-fill[j], j)):
        if micro and (len(micro[-1]) + 1) * widest <= budget:
            micro[-1].append(rows[r])
        else:
            micro.append([rows[r]])
            widest = fill[r]
    return micro


def plan_padded(lengths: Sequence[int], budget: int) -> list[list[list[int]]]:
    """One sequence per row; rows x longest row within ``budget`` (longest first)."""
    micro: list[list[list[int]]] = []
    widest = 0
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        if micro and (len(micro[-1]) + 1) * widest <= budget:
            micro[-1].append([i])
        else:
            micro.append([[i]])
            widest = lengths[i]
    return micro


def micro_batches(
    batch: TrainingBatch,
    seqs: Sequence[int],
    budget: int,
    row_tokens: int | None = None,
    packed: bool = True,
    pad_id: int = 0,
) -> list[MicroBatch]:
    """The micro-batches of sequences ``seqs`` of ``batch`` (packed or padded)."""
    lengths = [len(batch.sequences[i].input_ids) for i in seqs]
    plan = plan_rows(lengths, budget, row_tokens) if packed else plan_padded(lengths, budget)
    return [
        _assemble(batch, [[seqs[j] for j in row] for row in rows], pad_id, padded=not packed)
        for rows in plan
    ]


def rank_micro_batches(
    batch: TrainingBatch, seqs: Sequence[int], config: TrainerConfig, ctx: DistContext, pad_id: int
) -> list[MicroBatch]:
    """This rank's share of ``seqs`` (balanced by tokens), as micro-batches; padded with
    dummies to the ranks' largest count, so every rank runs the same collectives."""
    lengths = [len(s.input_ids) for s in batch.sequences]
    share = split_across_ranks(seqs, lengths, ctx.world_size)[ctx.rank]
    mine = micro_batches(
        batch, share, config.micro_batch_tokens, config.row_tokens, config.packing, pad_id
    )
    count = all_reduce_max(len(mine), ctx)
    return mine + [dummy_micro_batch(pad_id)] * (count - len(mine))


def _assemble(batch: TrainingBatch, rows: list[list[int]], pad_id: int, padded: bool) -> MicroBatch:
    widths = [sum(len(batch.sequences[i].input_ids) for i in row) for row in rows]
    shape = (len(rows), max(widths))
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    keep = torch.zeros(shape, dtype=torch.bool)
    targets, temperature, order = [], [], []
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            seq = batch.sequences[i]
            n = len(seq.input_ids)
            ids = torch.from_numpy(seq.input_ids)
            input_ids[r, offset : offset + n] = ids
            position_ids[r, offset : offset + n] = torch.arange(n)
            positions = torch.from_numpy(seq.positions)
            keep[r, offset + positions - 1] = True  # logits at p - 1 predict token p
            targets.append(ids[positions])
            temperature.append(torch.full((len(positions),), seq.temperature))
            order.append(i)
            offset += n
        position_ids[r, offset:] = torch.arange(shape[1] - offset)  # padding: a block of its own
    attention_mask = None
    if padded:
        attention_mask = (torch.arange(shape[1])[None, :] < torch.tensor(widths)[:, None]).long()
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        keep=keep,
        targets=torch.cat(targets),
        temperature=torch.cat(temperature),
        token_index=batch.token_index(order),
        sequences=tuple(order),
        num_tokens=sum(widths),
    )


def dummy_micro_batch(pad_id: int = 0) -> MicroBatch:
    """Two pad tokens and one kept logit: a forward/backward that contributes nothing."""
    return MicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.long),
        position_ids=torch.arange(2)[None, :],
        attention_mask=None,
        keep=torch.tensor([[True, False]]),
        targets=torch.full((1,), pad_id, dtype=torch.long),
        temperature=torch.ones(1),
        token_index=torch.zeros(0, dtype=torch.long),
        sequences=(),
        num_tokens=0,
        dummy=True,
    )


def forward_logprobs(model: torch.nn.Module, micro: MicroBatch) -> tuple[Tensor, Tensor]:
    """Log-prob of every trained token and the logits it came from: (K,), (K, V).

    Both of the distribution the rollout sampled from: ``log_softmax(logits / T)`` with
    each token's own T (its Group's temperature), as SGLang and the CPU engine report.

    One packed row passes ``logits_to_keep`` as a 1-D index (any transformers version);
    several rows need the 2-D boolean form (transformers 5).
    """
    rows = micro.keep.shape[0]
    keep = micro.keep[0].nonzero().squeeze(1) if rows == 1 else micro.keep
    out = model(
        input_ids=micro.input_ids,
        position_ids=micro.position_ids,
        attention_mask=micro.attention_mask,
        logits_to_keep=keep,
        use_cache=False,
    )
    logits = out.logits.reshape(-1, out.logits.shape[-1]).float()  # (K, V)
    logits = logits / micro.temperature[:, None]  # exact where T = 1
    logp = logits.log_softmax(-1).gather(1, micro.targets[:, None]).squeeze(1)  # (K,)
    return logp, logits
