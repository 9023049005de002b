"""Multi-process training: FSDP2 sharding, rank roles, the batch split across ranks.

Under ``torchrun`` (WORLD_SIZE > 1) every rank builds the same ``Trainer``; the policy
and the reference are sharded with FSDP2 ``fully_shard`` (each decoder layer, then the
root), on CUDA with NCCL and on CPU with gloo alike (FSDP2 runs on gloo in torch 2.13,
so the CPU test exercises the same code as the GPU cluster). Rank 0 alone talks to Redis
and HTTP: it calls the step's and the checkpoint's functions over the trainer, which
broadcast the command and its inputs (the groups) to the other ranks with ``lead``; they
wait in ``follow``. Every rank then builds the identical batch and takes its share of
each mini-batch.

Gradients: FSDP2 averages them over ranks, so each rank's loss is scaled by the world
size; with per-token weights over the whole mini-batch (``mempo.losses.agg_weights``) the
update equals one process on the whole batch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """Where this process stands: rank, world size, its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "cpu") -> DistContext:
    """Join the torchrun process group when there is one (NCCL on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not dist.is_initialized():
        return DistContext(device=torch.device(device))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    ctx = DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"),
    )
    log.info("rank %s of %s on %s", ctx.rank, ctx.world_size, ctx.device)
    return ctx


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the classes HF names in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: nn.Module, ctx: DistContext, compute_dtype: torch.dtype) -> nn.Module:
    """FSDP2: shard every decoder layer, then the root (embeddings, norm, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layers = decoder_layers(model)
    if not layers:
        log.warning("no decoder layer found in %s: sharding the root only", type(model).__name__)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def broadcast_object(obj: Any, ctx: DistContext) -> Any:
    """Rank 0's ``obj`` on every rank (pickled)."""
    if not ctx.sharded:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def lead(ctx: DistContext, command: str, payload: Any) -> None:
    """Rank 0: send ``command`` and its inputs to the ranks waiting in ``follow``. Nothing
    to do without ranks, or on a rank > 0 (it is running the command already)."""
    if ctx.sharded and ctx.is_main:
        broadcast_object((command, payload), ctx)


def follow(ctx: DistContext, handlers: Mapping[str, Callable[[Any], object]]) -> None:
    """Ranks > 0: run rank 0's commands, ``handlers[command](payload)``, until "stop"."""
    while True:
        command, payload = broadcast_object(None, ctx)
        if command == "stop":
            return
        handlers[command](payload)


def release(ctx: DistContext) -> None:
    """Rank 0: stop the ranks in ``follow``; every rank: leave the process group, together
    (a rank that tears gloo down while another still talks to it can abort at exit)."""
    if ctx.sharded:
        lead(ctx, "stop", None)
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over ranks, in place on a device copy; returns a CPU tensor."""
    if not ctx.sharded:
        return tensor
    work = tensor.to(ctx.device)
    dist.all_reduce(work, op=dist.ReduceOp.SUM)
    return work.cpu()


def reduce_sums(sums: Mapping[str, torch.Tensor], ctx: DistContext) -> dict[str, float]:
    """Named scalar sums added over ranks in one collective (every rank, the same names)."""
    stacked = torch.stack([value.double() for value in sums.values()]).cpu()
    return dict(zip(sums, all_reduce_sum(stacked, ctx).tolist(), strict=True))


def all_reduce_max(value: int, ctx: DistContext) -> int:
    if not ctx.sharded:
        return value
    work = torch.tensor([value], device=ctx.device)
    dist.all_reduce(work, op=dist.ReduceOp.MAX)
    return int(work.item())


def split_across_ranks(
    seqs: Sequence[int], lengths: Sequence[int], world_size: int
) -> list[list[int]]:
    """Balance sequences over ranks by tokens: longest first, to the least loaded rank.

    Deterministic, so every rank computes the same split from the same batch.
    """
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(seqs, key=lambda j: (-lengths[j], j)):
        r = min(range(world_size), key=lambda k: (load[k], k))
        shares[r].append(i)
        load[r] += lengths[i]
    return shares


def full_model_state(model: nn.Module, ctx: DistContext) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU: complete on rank 0 (empty elsewhere when sharded)."""
    if not ctx.sharded:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dict(get_model_state_dict(model, options=options))  # type: ignore[arg-type]


def full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext
) -> dict[str, Any]:
    """The optimizer's state keyed by parameter names (so it loads into any wrapping)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=ctx.sharded)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
) -> None:
    """Load full (unsharded) states into a plain or FSDP2-sharded model and its optimizer."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, dict(model_state), options=options)  # type: ignore[arg-type]
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
