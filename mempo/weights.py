"""safetensors without extra copies: zero-copy reading, and writing straight from tensors.

``map_safetensors`` maps each file privately (copy-on-write) and returns tensors that
view the mapping: no bytes are copied until a tensor is written, and a file the learner
has just written is read straight from the page cache. The mapping stays valid when the
file is deleted later (the learner's retention), because the mapping holds the inode.

``write_safetensors`` streams each tensor's bytes from its own memory into the file
(safetensors' ``save_file`` first builds the whole file in memory): one copy per publish.

Format: 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the data, offsets relative to its start.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class WeightsFormatError(ValueError):
    pass


def map_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise WeightsFormatError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > 100_000_000:
            raise WeightsFormatError(f"{path}: implausible header length {length}")
        try:
            header = json.loads(handle.read(length))
        except ValueError as exc:
            raise WeightsFormatError(f"{path}: unreadable header ({exc})") from exc
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + length
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(spec.get("dtype"))
        begin, end = spec.get("data_offsets", (0, -1))
        shape = spec.get("shape")
        if (
            dtype is None
            or not isinstance(shape, list)
            or not 0 <= begin <= end
            or start + end > len(mapping)
        ):
            raise WeightsFormatError(f"{path}: bad entry for {name!r}")
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        flat = (
            torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + begin)
            if count
            else torch.empty(0, dtype=dtype)
        )
        tensors[name] = flat.reshape(shape)
    return tensors


def map_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory``, zero-copy."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightsFormatError(f"no *.safetensors in {directory}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(map_safetensors_file(file))
    return state


_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def write_safetensors(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` (CPU) as one safetensors file, data in name order."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    ordered = sorted(tensors.items())
    for name, tensor in ordered:
        if tensor.dtype not in _NAMES:
            raise WeightsFormatError(f"{name}: dtype {tensor.dtype} cannot be stored")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        for _, tensor in ordered:
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            if flat.numel():
                handle.write(flat.view(torch.uint8).numpy().data)
