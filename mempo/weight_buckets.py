"""A weight update's tensors in buckets: split, flatten to bytes, and view back (what the
learner broadcasts and an engine receives; mempo/weight_sync.py moves them)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[NamedTensors]:
    """Consecutive runs of ``named`` of at most ``bucket_bytes`` each (a larger tensor alone)."""
    out: list[NamedTensors] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if not out or (out[-1] and size + nbytes > bucket_bytes):
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def flatten(named: NamedTensors) -> torch.Tensor:
    """The bucket's bytes as one uint8 tensor, in order."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named])


def empty_bucket(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> torch.Tensor:
    """A zeroed uint8 buffer that receives a flattened bucket of these tensors (zeroed: a
    sender that sends fewer bytes leaves zeros, never the memory the buffer held)."""
    return torch.zeros(bucket_bytes(dtypes, shapes), dtype=torch.uint8)


def unflatten(
    buffer: torch.Tensor,
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
) -> dict[str, torch.Tensor]:
    """The tensors of a flattened bucket, viewing ``buffer`` (no copy)."""
    if buffer.numel() != bucket_bytes(dtypes, shapes):
        raise ValueError(f"a bucket of {buffer.numel()} bytes does not hold these tensors")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        size = math.prod(shape) * dtype.itemsize
        if offset % dtype.itemsize:  # views need aligned elements (SGLang refuses it too)
            raise ValueError(f"{name}: byte offset {offset} is not aligned for {dtype}")
        out[name] = buffer[offset : offset + size].view(dtype).reshape(list(shape))
        offset += size
    return out


def bucket_bytes(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> int:
    """The bytes of a bucket of tensors of these dtypes and shapes."""
    return sum(math.prod(s) * d.itemsize for d, s in zip(dtypes, shapes, strict=True))
