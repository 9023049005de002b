"""Answer log-probs of scoring plans: the prefix-shared forward and the naive reference.

Prefix-shared (``shared_logprobs``): one causal forward over every row's trunk (rows
right-padded, so no mask is needed and SDPA keeps its causal fast path) fills a KV
cache; then the rows' branch tokens run over that cache (one forward, or two when the
branches rooted at the prompt can use a cache cropped to it, see ``_passes``) with a
4D additive mask: a branch token sees ``trunk[:attach]``, its ancestor segments and its
own segment up to itself, and its position id continues from the attach point. Only
positions that predict an answer token are projected onto the vocabulary (transformers
5's boolean ``logits_to_keep``; models that ignore it give all logits, then indexed).

``score_rows`` splits rows into sub-batches of similar length within a token budget and
runs either path on each: the one entry point of the scorer service and its benchmark.

Naive (``naive_logprobs``): one plain forward per scored segment over
``context + answer``; the reference the shared path must match.

Glossary: B rows, L trunk tokens, Q branch tokens, N predicting positions, V vocab.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.scorer.plan import LogProbTable, Row

LOGSUMEXP_CHUNK = 2048  # predicting positions per log-softmax chunk (bounds fp32 copies)
# A row joins a sub-batch only if it is at least this fraction of the sub-batch's longest
# row: right-padding then wastes at most 10% of a forward (16 oracle trajectories of 8
# rounds: 0.66 s in 4 sub-batches vs 0.95 s in one, benchmarks/scorer_prefix_sharing.py).
MIN_FILL = 0.9


@dataclass(frozen=True)
class _Branch:
    """Some of one row's segments (whole trees), laid out for a branch forward."""

    row: int
    ids: list[int]  # (Q_b,)
    positions: list[int]  # (Q_b,)
    segment_of: list[int]  # (Q_b,) local segment index of each token
    attach: list[int]  # (S_b,) trunk tokens each segment sees
    visible: torch.Tensor  # (S_b, S_b) bool: [s, a] = a is s or an ancestor of s
    targets: list[tuple[int, int, int]]  # (row's segment index, predictor index, token id)


def _layout(row_index: int, row: Row, chosen: Sequence[int]) -> _Branch:
    """Lay out the segments ``chosen`` (parents before children, closed under descent)."""
    local = {s: i for i, s in enumerate(chosen)}
    starts: list[int] = []  # branch-local start of each chosen segment
    depth: list[int] = []  # position id of its first token
    ids: list[int] = []
    positions: list[int] = []
    segment_of: list[int] = []
    visible = torch.zeros(len(chosen), len(chosen), dtype=torch.bool)
    targets = []
    for i, s in enumerate(chosen):
        seg = row.segments[s]
        parent = None if seg.parent is None else local[seg.parent]
        base = (
            seg.attach if parent is None else depth[parent] + len(row.segments[chosen[parent]].ids)
        )
        starts.append(len(ids))
        depth.append(base)
        ids.extend(seg.ids)
        positions.extend(range(base, base + len(seg.ids)))
        segment_of.extend([i] * len(seg.ids))
        visible[i, i] = True
        if parent is not None:
            visible[i] |= visible[parent]
        if seg.scored:
            assert parent is not None, "scored segments have a parent"
            parent_last = starts[parent] + len(row.segments[chosen[parent]].ids) - 1
            for j, token in enumerate(seg.ids):
                targets.append((s, parent_last if j == 0 else starts[i] + j - 1, token))
    attach = [row.segments[s].attach for s in chosen]
    return _Branch(row_index, ids, positions, segment_of, attach, visible, targets)


def _trees(row: Row) -> list[list[int]]:
    """The row's segments grouped by root segment, in order."""
    trees: dict[int, list[int]] = {}
    root_of: dict[int, int] = {}
    for s, seg in enumerate(row.segments):
        root_of[s] = s if seg.parent is None else root_of[seg.parent]
        trees.setdefault(root_of[s], []).append(s)
    return list(trees.values())


def _passes(rows: Sequence[Row]) -> list[tuple[int, list[_Branch]]]:
    """Branch forwards to run, longest keys first: (keys needed, branches).

    Attention over the cache costs queries x keys, so when the trees rooted at each
    row's earliest branch point (P_mem's task prompt, say) need at most half of the
    trunk, they run in a second pass over the cache cropped to what they see.
    """
    trunk_len = max(len(r.trunk) for r in rows)
    trees = [_trees(r) for r in rows]
    firsts = [
        min((r.segments[t[0]].attach for t in ts), default=0)
        for r, ts in zip(rows, trees, strict=True)
    ]
    near_len = max(firsts)
    split = 2 * near_len <= trunk_len
    far: list[_Branch] = []
    near: list[_Branch] = []
    for b, (row, ts, first) in enumerate(zip(rows, trees, firsts, strict=True)):
        near_trees = [t for t in ts if split and row.segments[t[0]].attach == first]
        far_trees = [t for t in ts if t not in near_trees]
        far.append(_layout(b, row, [s for t in far_trees for s in t]))
        near.append(_layout(b, row, [s for t in near_trees for s in t]))
    passes = [(trunk_len, far), (near_len, near)]
    return [(k, p) for k, p in passes if any(br.ids for br in p)]


def _branch_mask(
    branches: Sequence[_Branch], trunk_len: int, q: int, dtype: torch.dtype
) -> torch.Tensor:
    """(B, 1, Q, K + Q) additive mask: 0 where a branch token may look, dtype-min elsewhere."""
    allowed = torch.zeros(len(branches), q, trunk_len + q, dtype=torch.bool)
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    for b, br in enumerate(branches):
        n = len(br.ids)
        if n:
            seg = torch.tensor(br.segment_of, dtype=torch.long)  # (Q_b,)
            attach = torch.tensor(br.attach, dtype=torch.long)[seg]  # (Q_b,)
            allowed[b, :n, :trunk_len] = torch.arange(trunk_len)[None, :] < attach[:, None]
            allowed[b, :n, trunk_len : trunk_len + n] = br.visible[seg][:, seg] & causal[:n, :n]
        pad = torch.arange(n, q)
        allowed[b, pad, trunk_len + pad] = True  # padding queries look at themselves only
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]  # (B, 1, Q, K + Q)


def _cache_kwarg(model: Any) -> str:
    """transformers 5 names the KV-cache argument ``cache``; 4.x ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _token_logprobs(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits[rows])[tokens], computed in fp32 chunks. (N, V) -> (M,)."""
    lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)  # (N,)
    for i in range(0, logits.shape[0], LOGSUMEXP_CHUNK):
        lse[i : i + LOGSUMEXP_CHUNK] = torch.logsumexp(logits[i : i + LOGSUMEXP_CHUNK].float(), -1)
    return logits[rows, tokens].float() - lse[rows]


def sub_batches(rows: Sequence[Row], budget: int) -> list[list[int]]:
    """Row indices grouped by size: rows x longest row stays within ``budget``, and every
    row is at least ``MIN_FILL`` of its sub-batch's longest (little padding)."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].num_tokens, reverse=True)
    batches: list[list[int]] = []
    for i in order:
        if batches:
            longest = rows[batches[-1][0]].num_tokens  # the first row of a batch is its longest
            fits = longest * (len(batches[-1]) + 1) <= budget
            if fits and rows[i].num_tokens >= MIN_FILL * longest:
                batches[-1].append(i)
                continue
        batches.append([i])
    return batches


def score_rows(
    model: Any, rows: Sequence[Row], budget: int, method: str = "shared", pad_id: int = 0
) -> LogProbTable:
    """Answer log-probs of every scored segment of ``rows``, keyed (row index, segment);
    ``method`` "shared" (prefix-shared) or "naive" (the reference)."""
    table: LogProbTable = {}
    for group in sub_batches(rows, budget):
        chosen = [rows[i] for i in group]
        if method == "naive":
            part = naive_logprobs(model, chosen)
        else:
            part = shared_logprobs(model, chosen, pad_id)
        table.update({(group[r], s): v for (r, s), v in part.items()})
    return table


@torch.no_grad()
def shared_logprobs(model: Any, rows: Sequence[Row], pad_id: int = 0) -> LogProbTable:
    """Per-token answer log-probs of every scored segment, keyed (row index, segment)."""
    device = next(model.parameters()).device
    trunk_len = max(len(r.trunk) for r in rows)
    cache = None
    if trunk_len:
        trunk = torch.full((len(rows), trunk_len), pad_id, dtype=torch.long)  # (B, L), right-padded
        for b, r in enumerate(rows):
            trunk[b, : len(r.trunk)] = torch.tensor(r.trunk, dtype=torch.long)
        out = model(input_ids=trunk.to(device), use_cache=True, logits_to_keep=1)
        cache = getattr(out, "cache", None) or out.past_key_values
    table: LogProbTable = {}
    cached = trunk_len
    for key_len, branches in _passes(rows):
        if cache is not None and cached > key_len:
            cache.crop(key_len - cached)  # negative: drop the tail (transformers 4.x and 5.x)
        _branch_forward(model, cache, key_len, branches, pad_id, table)
        cached = key_len + max(len(br.ids) for br in branches)
    return table


def _branch_forward(
    model: Any,
    cache: Any,
    key_len: int,
    branches: Sequence[_Branch],
    pad_id: int,
    table: LogProbTable,
) -> None:
    """One forward of the branches over ``key_len`` cached trunk tokens; fills ``table``."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    q = max(len(br.ids) for br in branches)
    ids = torch.full((len(branches), q), pad_id, dtype=torch.long)  # (B, Q)
    positions = torch.zeros((len(branches), q), dtype=torch.long)  # (B, Q)
    keep = torch.zeros((len(branches), q), dtype=torch.bool)  # (B, Q): predicts an answer token
    for b, br in enumerate(branches):
        if br.ids:
            ids[b, : len(br.ids)] = torch.tensor(br.ids, dtype=torch.long)
            positions[b, : len(br.ids)] = torch.tensor(br.positions, dtype=torch.long)
            keep[b, [t[1] for t in br.targets]] = True
    # (B, Q): where each kept position lands in the (N, V) logits
    flat_index = keep.flatten().cumsum(0).sub(1).view(keep.shape)
    kwargs: dict[str, Any] = {} if cache is None else {_cache_kwarg(model): cache}
    out = model(
        input_ids=ids.to(device),
        position_ids=positions.to(device),
        attention_mask=_branch_mask(branches, key_len, q, dtype).to(device),
        use_cache=cache is not None,
        logits_to_keep=keep.to(device),
        **kwargs,
    )
    logits = out.logits if out.logits.ndim == 2 else out.logits[keep.to(device)]  # (N, V)
    row_of = torch.tensor([b for b, br in enumerate(branches) for _ in br.targets])  # (M,)
    predictor = torch.tensor([t[1] for br in branches for t in br.targets])  # (M,)
    tokens = torch.tensor([t[2] for br in branches for t in br.targets])  # (M,)
    pred = flat_index[row_of, predictor].to(device)  # (M,)
    values = _token_logprobs(logits, pred, tokens.to(device)).tolist()
    keys = [(br.row, t[0]) for br in branches for t in br.targets]
    for key, value in zip(keys, values, strict=True):
        table.setdefault(key, []).append(value)


@torch.no_grad()
def naive_logprobs(model: Any, rows: Sequence[Row]) -> LogProbTable:
    """The reference: one plain forward of ``context + answer`` per scored segment."""
    device = next(model.parameters()).device
    table: LogProbTable = {}
    for b, row in enumerate(rows):
        for s in row.scored_segments():
            context, answer = row.context_of(s), list(row.segments[s].ids)
            ids = torch.tensor([context + answer], dtype=torch.long, device=device)  # (1, T)
            logits = model(input_ids=ids).logits[0, len(context) - 1 : -1]  # (A, V)
            targets = torch.arange(len(answer), device=device)
            tokens = torch.tensor(answer, device=device)
            table[(b, s)] = _token_logprobs(logits, targets, tokens).tolist()
    return table
