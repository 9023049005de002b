"""Checked weights into a live model (mempo.weights reads and checks them first).

``assign_weights`` makes the tensors a model's parameters without copying them;
``module_tree_copy`` gives a model to assign them to while the original keeps serving;
``own_tensors`` copies a model's CPU tensors out of the files transformers mapped.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy
import torch

from mempo.weights import WeightsFormatError


def assign_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Make ``state``'s tensors the model's parameters (and buffers) without copying them
    (checked first: check_weights; same device and dtype as the model's; each parameter
    keeps its ``requires_grad``). Tied weights (lm_head = embeddings) are tied again to
    whichever of them ``state`` holds."""
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    for name, tensor in state.items():  # straight into the tables: load_state_dict's
        owner, _, leaf = name.rpartition(".")  # checks cost 14 us a tensor
        module = model.get_submodule(owner)
        old = module._parameters.get(leaf)
        if old is not None:
            module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)
        elif leaf in module._buffers:
            module._buffers[leaf] = tensor
        else:
            raise WeightsFormatError(f"the model has no parameter or buffer {name!r}")
    for names in tied.values():  # re-tie each shared group to the tensor that was loaded
        source = next((n for n in names if n in state), None)
        if source is None or len(names) == 1:
            continue
        loaded = model.get_parameter(source)
        for name in names:
            if name != source:
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._parameters[leaf] = loaded


def module_tree_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A new tree of modules over ``model``'s own parameters, buffers and attributes: each
    module copied shallowly with its own parameter, buffer and child tables, so that
    ``assign_weights`` on the copy leaves ``model`` untouched. Nothing is deep-copied (a
    deep copy of a transformer's modules costs milliseconds of Python per publish)."""
    copies: dict[int, torch.nn.Module] = {}

    def copied(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) not in copies:  # a module shared by two parents stays shared
            new = copies[id(module)] = copy.copy(module)
            new._parameters = dict(module._parameters)
            new._buffers = dict(module._buffers)
            new._modules = {
                name: None if child is None else copied(child)
                for name, child in module._modules.items()
            }
        return copies[id(module)]

    return copied(model)


def own_tensors(model: torch.nn.Module) -> None:
    """Give every CPU parameter and buffer of ``model`` memory of its own, one tensor at a
    time (each keeps its identity: tied weights stay tied). transformers' ``from_pretrained``
    leaves a CPU tensor whose dtype is the file's a view of the safetensors file's memory
    mapping: a rewrite of the file in place would change what is served, a truncation kill
    the process (SIGBUS). Call it on every model a service serves after loading it. The
    mapped pages are the file's (the page cache), not the process's memory: the memory
    peak is the model plus one tensor."""
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.device.type == "cpu":
                tensor.data = _copied(tensor.data)


def _copied(source: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU tensor in new memory. One thread's memcpy (numpy's): torch's
    parallel copy out of a freshly mapped file took 8x as long on 2 threads (0.46 s
    against 0.06 s for 104 MB, both faulting the pages in)."""
    if not source.is_contiguous() or not source.numel():
        return source.clone()
    copy = torch.empty_like(source, memory_format=torch.contiguous_format)
    numpy.copyto(_bytes(copy), _bytes(source))
    return copy


def _bytes(tensor: torch.Tensor) -> numpy.ndarray:
    return tensor.reshape(-1).view(torch.uint8).numpy()
