"""Zero-copy safetensors reading equals safetensors' own loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mempo.weights import WeightsFormatError, map_safetensors


def test_equals_load_file(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.arange(10, dtype=torch.int64),
        "c": torch.randn(2, 2).to(torch.bfloat16),
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(1.5),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    mapped = map_safetensors(tmp_path)
    reference = load_file(tmp_path / "model.safetensors")
    assert mapped.keys() == reference.keys()
    for name, tensor in reference.items():
        assert mapped[name].dtype == tensor.dtype and mapped[name].shape == tensor.shape
        assert torch.equal(mapped[name], tensor), name
    mapped["a"].add_(1)  # copy-on-write: the file is untouched
    assert torch.equal(load_file(tmp_path / "model.safetensors")["a"], tensors["a"])


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(WeightsFormatError, match="no"):
        map_safetensors(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(b"\x05")
    with pytest.raises(WeightsFormatError, match="too short"):
        map_safetensors(tmp_path)
    (tmp_path / "x.safetensors").write_bytes((4).to_bytes(8, "little") + b"nope")
    with pytest.raises(WeightsFormatError, match="header"):
        map_safetensors(tmp_path)


def test_write_round_trips_through_safetensors(tmp_path: Path) -> None:
    from mempo.weights import write_safetensors

    tensors = {
        "w": torch.randn(4, 3),
        "b": torch.randn(2).to(torch.bfloat16),
        "i": torch.arange(5),
        "z": torch.zeros(0),
        "t": torch.randn(3, 4).t(),  # not contiguous
    }
    write_safetensors(tensors, tmp_path / "m.safetensors", metadata={"format": "pt"})
    back = load_file(tmp_path / "m.safetensors")
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert all(torch.equal(map_safetensors(tmp_path)[k], v) for k, v in tensors.items())
