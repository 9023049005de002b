"""Weight folders that must never load, shared by the CPU engine's and the scorer's tests.

Each is a folder inside a weights root, built from the tiny model (config and tokenizer
files copied, so a loader that reads the whole folder would take it):

- 400: NaN or inf in a tensor, one tensor only, an empty state, an unexpected tensor, and
  malformed safetensors headers (a JSON list, a non-object entry, string offsets);
- 403: a folder inside the root whose model.safetensors is a symlink to a file outside.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REFUSED_400 = (
    "nan",
    "inf",
    "one_tensor",
    "no_tensor",
    "unexpected",
    "header_list",
    "entry_not_object",
    "string_offsets",
)
REFUSED_403 = ("symlinked_file",)


def _raw(path: Path, header: object, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _copy_config(model_dir: Path, folder: Path) -> Path:
    folder.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors"):
            shutil.copy2(item, folder / item.name)
    return folder / "model.safetensors"


def build(model_dir: Path, root: Path) -> dict[str, Path]:
    """Every refused folder under ``root`` (created), by case name; plus ``good``."""
    state = load_file(str(model_dir / "model.safetensors"))
    first = sorted(n for n, t in state.items() if t.is_floating_point())[0]
    folders: dict[str, Path] = {}

    def folder(name: str) -> Path:
        folders[name] = root / name
        return _copy_config(model_dir, root / name)

    shutil.copytree(model_dir, root / "good")
    folders["good"] = root / "good"
    for name, value in (("nan", float("nan")), ("inf", float("inf"))):
        poisoned = {k: v.clone() for k, v in state.items()}
        poisoned[first].reshape(-1)[0] = value
        save_file(poisoned, str(folder(name)))
    save_file({first: state[first]}, str(folder("one_tensor")))
    save_file({}, str(folder("no_tensor")))
    save_file({**state, "model.extra.weight": torch.ones(3)}, str(folder("unexpected")))
    _raw(folder("header_list"), [1, 2, 3])
    _raw(folder("entry_not_object"), {first: 5})
    _raw(
        folder("string_offsets"),
        {first: {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}},
        b"\0" * 4,
    )
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir(exist_ok=True)
    shutil.copy2(model_dir / "model.safetensors", outside / "model.safetensors")
    folder("symlinked_file").symlink_to(outside / "model.safetensors")
    return folders
