"""safetensors without extra copies: reading, and writing straight from tensors.

``read_safetensors`` reads each tensor's bytes into a tensor of its own (one copy): what
a service serves never aliases a file, so a loaded file rewritten in place or truncated
changes nothing served and cannot kill the process (SIGBUS). ``map_safetensors`` returns
views of a private mapping, zero-copy: only for files not served afterwards (the
learner's check of its own export). ``write_safetensors`` streams each tensor's bytes
into the file (``save_file`` first builds the whole file in memory); with ``finite`` it
checks them for NaN / inf on a second thread meanwhile. Format: 8-byte little-endian
header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin,
end]}, "__metadata__": {...}}``, then the data, offsets relative to its start.

Whatever arrives over ``/update_weights_from_disk`` passes through here (the CPU engine
and the scorer), so the reader trusts nothing: every file must be a regular file that
resolves inside the weights root (a symlink to outside is refused, checked on the file
actually opened), the header must be exactly the format above (anything else is a
``WeightsFormatError``, which services answer with 400), and ``check_weights`` holds a
state against the model's own: no missing, unexpected or reshaped tensor, no NaN / inf.
``load_checked`` is both, on tensors read (not mapped); it skips the NaN / inf scan of
files the learner sealed after its own check (``seal``) while they are exactly the files
it sealed, from opening to last byte. mempo.model_weights puts them into a live model.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import stat
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
SEAL = "finite.json"  # beside published weights: the learner checked these files finite
_FINITE_CHUNK = 1 << 24  # elements checked at once: bounds the check's temporary memory


class WeightsFormatError(ValueError):
    """A weights file or folder that is not a loadable checkpoint (callers answer 400)."""


class WeightsOutsideRoot(WeightsFormatError):
    """A weights file that resolves outside the weights root (a symlink out of it)."""


class NonFiniteWeights(WeightsFormatError):
    """A tensor holds NaN or inf: such weights are never published or loaded."""


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _open_checked(path: Path, root: Path | None) -> int:
    """A read-only descriptor of ``path``: a regular file that, when ``root`` is given,
    resolves inside it. The check is made on the inode actually opened, so a file
    swapped for a symlink between the check and the open is refused too."""
    try:  # O_NONBLOCK: opening a FIFO must not hang the caller
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise WeightsFormatError(f"{path.name}: cannot open ({exc.strerror})") from exc
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise WeightsFormatError(f"{path.name}: not a regular file")
        if root is not None:
            real, real_root = os.path.realpath(path), os.path.realpath(root)
            try:
                named = os.stat(real)
            except OSError as exc:
                raise WeightsOutsideRoot(f"{path.name}: changed while being opened") from exc
            same = (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)
            if not (same and _inside(real, real_root)):
                raise WeightsOutsideRoot(f"{path.name} resolves outside the weights root")
            # A hard link is the same file inside and out: whoever made it could make the
            # root serve a file it does not own. Only single-link files of ours or root's.
            if opened.st_nlink > 1:
                raise WeightsOutsideRoot(
                    f"{path.name} has {opened.st_nlink} hard links: weights files must have one"
                )
            if opened.st_uid not in (os.geteuid(), 0):
                raise WeightsOutsideRoot(f"{path.name} belongs to another user (uid {opened.st_uid})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_header(handle: Any, path: Path, size: int) -> tuple[dict[str, Any], int]:
    """The parsed JSON header (a dict) and where the data starts."""
    head = handle.read(8)
    if len(head) != 8:
        raise WeightsFormatError(f"{path.name}: too short for a safetensors file")
    (length,) = struct.unpack("<Q", head)
    if length > min(100_000_000, size - 8):
        raise WeightsFormatError(f"{path.name}: implausible header length {length}")
    try:
        header = json.loads(handle.read(length))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise WeightsFormatError(f"{path.name}: unreadable header ({exc})"[:300]) from exc
    if not isinstance(header, dict):
        raise WeightsFormatError(
            f"{path.name}: the header is a JSON {type(header).__name__}, not an object"
        )
    return header, 8 + length


def _entry(
    name: str, spec: object, data_size: int, path: Path
) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype, shape, begin, end) of one header entry, every field checked."""
    if not isinstance(spec, dict):
        raise WeightsFormatError(f"{path.name}: entry {name!r} is not an object")
    name_of_dtype = spec.get("dtype")
    dtype = _DTYPES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
    if dtype is None:
        raise WeightsFormatError(f"{path.name}: {name!r} has an unknown dtype")
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not (isinstance(shape, list) and all(_count(d) for d in shape)):
        raise WeightsFormatError(f"{path.name}: {name!r} needs a shape of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)):
        raise WeightsFormatError(f"{path.name}: {name!r} needs data_offsets [begin, end] as ints")
    begin, end = offsets
    size = math.prod(shape) * dtype.itemsize
    if not (begin <= end <= data_size and end - begin == size):
        raise WeightsFormatError(
            f"{path.name}: {name!r} data_offsets [{begin}, {end}] do not hold {size} bytes "
            f"of {data_size}"
        )
    return dtype, shape, begin, end


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entries(handle: Any, path: Path) -> tuple[os.stat_result, int, dict[str, tuple[torch.dtype, list[int], int, int]]]:
    """The opened file's stat, where its data starts, and each tensor's checked entry."""
    opened = os.fstat(handle.fileno())
    header, start = _read_header(handle, path, opened.st_size)
    entries = {name: _entry(name, spec, opened.st_size - start, path) for name, spec in header.items() if name != "__metadata__"}
    return opened, start, entries


def _map_file(path: Path, root: Path | None) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Every tensor of one safetensors file, zero-copy, and the opened file's identity."""
    with os.fdopen(_open_checked(Path(path), root), "rb") as handle:
        opened, start, entries = _entries(handle, path)
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    tensors: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, begin, end) in entries.items():
        count = (end - begin) // dtype.itemsize
        flat = (
            torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + begin)
            if count
            else torch.empty(0, dtype=dtype)
        )
        tensors[name] = flat.reshape(shape)
    return tensors, _identity(opened)


def _read_file(path: Path, root: Path | None) -> tuple[dict[str, torch.Tensor], list[int] | None]:
    """Every tensor of one safetensors file, read into memory of its own (no mapping: a
    file rewritten or truncated later changes nothing read), and the opened file's
    identity, None when it changed while being read (no seal matches None). Unbuffered:
    every byte comes from the file between the two identities, straight into its tensor."""
    with os.fdopen(_open_checked(Path(path), root), "rb", buffering=0) as handle:
        opened, start, entries = _entries(handle, path)
        tensors: dict[str, torch.Tensor] = {}  # read in file order: one pass over it
        for name, (dtype, shape, begin, end) in sorted(entries.items(), key=lambda e: e[1][2]):
            if end == begin:
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            raw = torch.empty(end - begin, dtype=torch.uint8)
            _read_exactly(handle, raw.numpy().data, start + begin, path)
            tensors[name] = raw.view(dtype).reshape(shape)
        changed = _identity(os.fstat(handle.fileno())) != _identity(opened)
    return {name: tensors[name] for name in entries}, None if changed else _identity(opened)


def _read_exactly(handle: Any, into: memoryview, offset: int, path: Path) -> None:
    handle.seek(offset)
    done = 0
    while done < len(into):
        got = handle.readinto(into[done:])
        if not got:  # the file shrank after its header was read
            raise WeightsFormatError(f"{path.name}: truncated while being read")
        done += got


def _map_folder(
    directory: Path, root: Path | None, read: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, list[int] | None]]:
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightsFormatError(f"no *.safetensors in {directory}")
    state: dict[str, torch.Tensor] = {}
    identities: dict[str, list[int] | None] = {}
    for file in files:
        tensors, identities[file.name] = (_read_file if read else _map_file)(file, root)
        for name, tensor in tensors.items():
            if name in state:
                raise WeightsFormatError(f"{name!r} appears in more than one file of {directory}")
            state[name] = tensor
    return state, identities


def map_safetensors(directory: Path, root: Path | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory``, zero-copy.

    ``root``: every file must resolve inside it (``WeightsOutsideRoot`` otherwise)."""
    return _map_folder(directory, root)[0]


def read_safetensors(directory: Path, root: Path | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in ``directory``, read into tensors of
    their own, one at a time (no mapping, no second copy of a file): what a service may
    serve. ``root`` as for ``map_safetensors``."""
    return _map_folder(directory, root, read=True)[0]


def load_checked(
    directory: Path, expected: Mapping[str, torch.Tensor], root: Path | None = None
) -> dict[str, torch.Tensor]:
    """``read_safetensors`` then ``check_weights`` against ``expected`` (a model's state
    dict): what a receiver of a publish runs; the tensors own their memory. The finite
    scan is skipped when the folder's seal (``seal``) records every file exactly as it
    was opened and, after its last byte was read, still was: the learner checked those
    bytes finite, and nobody has written, replaced or copied them since."""
    state, identities = _map_folder(directory, root, read=True)
    check_weights(state, expected, str(directory), finite=_read_seal(directory, root) != identities)
    return state


def _identity(opened: os.stat_result) -> list[int]:
    """What changes when a file is written, replaced or copied: inode, size, modification
    and change times (a chmod moves the change time too; nobody can set it)."""
    return [opened.st_ino, opened.st_size, opened.st_mtime_ns, opened.st_ctime_ns]


def seal(directory: Path) -> None:
    """Record that the ``*.safetensors`` files of ``directory``, as they are now, were
    checked finite (``SEAL``, read by ``load_checked``). Call it last: after the check and
    any chmod. Whoever can write the seal can write the weights (the receivers only read
    files of their own user or root), so it gives no one a power they lack; it spares each
    receiver a scan of every byte. Before Linux 6.13 file times move by the jiffy (a few
    ms): a write of the same size that soon after the seal can go unnoticed."""
    files = _identities(directory)
    path = Path(directory) / SEAL
    path.write_text(json.dumps({"checked": "finite", "files": files}))
    path.chmod(0o644)


def is_sealed(directory: Path) -> bool:
    """Whether ``directory``'s seal (``seal``) records its ``*.safetensors`` files as they
    are now (a folder with no such file is never sealed)."""
    now = _identities(directory)
    return bool(now) and _read_seal(directory, None) == now


def _identities(directory: Path) -> dict[str, list[int]]:
    return {p.name: _identity(p.stat()) for p in sorted(Path(directory).glob("*.safetensors"))}


def _read_seal(directory: Path, root: Path | None) -> dict[str, list[int]] | None:
    """The identities ``seal`` recorded, or None (no seal, or not one ``seal`` wrote)."""
    if not (Path(directory) / SEAL).exists():
        return None
    try:
        with os.fdopen(_open_checked(Path(directory) / SEAL, root), "rb") as handle:
            data = json.loads(handle.read(1_000_000))
    except (WeightsFormatError, OSError, ValueError, RecursionError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    return files if isinstance(files, dict) else None


def non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor holding NaN or inf, or None.

    A tensor whose sum is finite holds no NaN or inf (either would make the sum NaN or
    inf), so one reduction without a temporary clears it; only a non-finite sum (a NaN or
    inf, or finite values that overflow the sum) is looked at element by element.
    Every receiver of a publish runs this (benchmarks/weight_publish.py)."""
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        flat = tensor.detach().reshape(-1)
        total = flat.sum(dtype=torch.float64 if flat.dtype == torch.float64 else torch.float32)
        if bool(torch.isfinite(total)):
            continue
        for at in range(0, flat.numel(), _FINITE_CHUNK):
            if not bool(torch.isfinite(flat[at : at + _FINITE_CHUNK]).all()):
                return name
    return None


def check_finite(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Raise ``NonFiniteWeights`` naming the first tensor with NaN or inf."""
    if (name := non_finite(tensors)) is not None:
        raise NonFiniteWeights(f"{name} holds NaN or inf values in {where}")


def check_weights(
    state: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    where: str,
    finite: bool = True,
) -> None:
    """``state`` must fit a model whose state dict is ``expected``: the same names (a tied
    weight, sharing storage with a loaded one, may be left out), shapes, and (``finite``)
    finite values."""
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise WeightsFormatError(f"unexpected tensors {unexpected[:5]} in {where}")
    loaded_storage = {expected[name].data_ptr() for name in state}
    missing = [
        name
        for name in expected
        if name not in state and expected[name].data_ptr() not in loaded_storage
    ]  # a tied weight (lm_head = embeddings) arrives with the tensor it shares
    if missing:
        raise WeightsFormatError(f"missing tensors {missing[:5]} in {where}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise WeightsFormatError(
                f"{name}: shape {tuple(tensor.shape)} in {where}, "
                f"the model has {tuple(expected[name].shape)}"
            )
    if finite:
        check_finite(state, where)


_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def write_safetensors(
    tensors: dict[str, torch.Tensor],
    path: Path,
    metadata: dict[str, str] | None = None,
    finite: bool = False,
) -> None:
    """Write ``tensors`` (CPU) as one safetensors file, data in name order.

    ``finite``: also check them for NaN / inf (``NonFiniteWeights``, the file then half
    written: write into a temporary folder), on a second thread while the file is written:
    the check costs no time where a core is free."""
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
    check = _finite_checker().submit(non_finite, tensors) if finite else None
    try:
        with path.open("wb") as handle:
            handle.write(struct.pack("<Q", len(raw)))
            handle.write(raw)
            for _, tensor in ordered:
                flat = tensor.detach().cpu().contiguous().reshape(-1)
                if flat.numel():
                    handle.write(flat.view(torch.uint8).numpy().data)
    finally:
        bad = check.result() if check is not None else None  # never left running
    if bad is not None:
        raise NonFiniteWeights(f"{bad} holds NaN or inf values in {path.parent.name}")


@functools.cache
def _finite_checker() -> ThreadPoolExecutor:
    """One thread for every check, kept: torch's first parallel op on a new thread starts
    a new team of worker threads (10 ms, more than the check of a small model)."""
    return ThreadPoolExecutor(1, thread_name_prefix="finite-check")


os.register_at_fork(after_in_child=_finite_checker.cache_clear)  # a child has no such thread
