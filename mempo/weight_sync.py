"""Weights over torch.distributed: the group a learner and its engines join, and buckets.

SGLang's protocol (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``): the learner is rank 0 of a process group of its own,
each engine joins it at its ``rank_offset``; then, bucket by bucket, every engine is told
the bucket's names, dtypes and shapes over HTTP while the learner broadcasts the bytes.
With ``load_format="flattened_bucket"`` a bucket travels as one uint8 tensor, the
tensors' bytes one after the other in the order named (SGLang's FlattenedTensorBucket):
one collective per bucket, not one per tensor.

The group is made as SGLang makes it (``init_custom_process_group``): a TCP store at
``master_address:master_port`` (the learner, rank 0, holds it), prefixed with the group
name, and a process group over that store, apart from any default group (the learner's
FSDP group is another). gloo on CPU (this is what runs here), NCCL on GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

GROUP = "weight_update_group"
FLATTENED = "flattened_bucket"

NamedTensors = list[tuple[str, torch.Tensor]]
Group = Any  # a c10d backend: ProcessGroupGloo or ProcessGroupNCCL (no common stub type)


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = GROUP,
    backend: str = "gloo",
    timeout_s: float = 60.0,
) -> Group:
    """Join (rank 0: open) the weight-update group; returns once every rank has joined."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: gloo or nccl")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("backend nccl needs CUDA: on CPU use gloo")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


def broadcast(group: Group, tensor: torch.Tensor, src: int = 0) -> None:
    """Send (rank ``src``) or receive ``tensor`` in place; blocks until done."""
    options = dist.BroadcastOptions()
    options.rootRank = src
    group.broadcast([tensor], options).wait()


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
    """A uint8 buffer that receives a flattened bucket of these tensors."""
    return torch.empty(_bucket_bytes(dtypes, shapes), dtype=torch.uint8)


def unflatten(
    buffer: torch.Tensor,
    names: Sequence[str],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
) -> dict[str, torch.Tensor]:
    """The tensors of a flattened bucket, viewing ``buffer`` (no copy)."""
    if buffer.numel() != _bucket_bytes(dtypes, shapes):
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


def _bucket_bytes(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]]) -> int:
    return sum(math.prod(s) * d.itemsize for d, s in zip(dtypes, shapes, strict=True))
