"""Zero-copy safetensors reading equals safetensors' own loader; it refuses malformed
headers, files outside the weights root, and weights that do not fit the model."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mempo.weights import (
    NonFiniteWeights,
    WeightsFormatError,
    WeightsOutsideRoot,
    check_weights,
    map_safetensors,
    non_finite,
)


@pytest.mark.parametrize("how", ["mapped", "read"])
def test_equals_load_file(tmp_path: Path, how: str) -> None:
    from mempo.weights import read_safetensors

    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.arange(10, dtype=torch.int64),
        "c": torch.randn(2, 2).to(torch.bfloat16),
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(1.5),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    mapped = (map_safetensors if how == "mapped" else read_safetensors)(tmp_path)
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


def _raw(path: Path, header: object, data: bytes = b"") -> None:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


F32_1 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ([1, 2], "not an object"),
        ({"w": 5}, "not an object"),
        ({"w": {**F32_1, "data_offsets": ["0", "4"]}}, "data_offsets"),
        ({"w": {**F32_1, "data_offsets": [True, 4]}}, "data_offsets"),
        ({"w": {**F32_1, "data_offsets": [0]}}, "data_offsets"),
        ({"w": {**F32_1, "data_offsets": [0, 8]}}, "do not hold"),
        ({"w": {**F32_1, "shape": [2]}}, "do not hold"),
        ({"w": {**F32_1, "shape": [-1]}}, "shape"),
        ({"w": {**F32_1, "shape": "1"}}, "shape"),
        ({"w": {**F32_1, "dtype": ["F32"]}}, "dtype"),
        ({"w": {**F32_1, "dtype": "F8_E4M3"}}, "dtype"),
        (b"[" * 100_000 + b"]" * 100_000, "header"),  # nesting beyond the JSON parser
        (b'{"w": "\xff"}', "header"),  # not UTF-8
    ],
)
def test_malformed_headers_are_format_errors(tmp_path: Path, header: object, message: str) -> None:
    _raw(tmp_path / "model.safetensors", header, b"\0" * 4)
    with pytest.raises(WeightsFormatError, match=message):
        map_safetensors(tmp_path)


def test_every_file_must_resolve_inside_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "v1").mkdir(parents=True)
    outside.mkdir()
    save_file({"w": torch.ones(2)}, outside / "model.safetensors")
    (root / "v1" / "model.safetensors").symlink_to(outside / "model.safetensors")
    assert torch.equal(map_safetensors(root / "v1")["w"], torch.ones(2))  # no root: no check
    with pytest.raises(WeightsOutsideRoot, match="outside the weights root"):
        map_safetensors(root / "v1", root)
    save_file({"w": torch.ones(2)}, root / "v1" / "real.safetensors")
    (root / "v1" / "model.safetensors").unlink()
    (root / "v1" / "link.safetensors").symlink_to(root / "v1" / "real.safetensors")
    with pytest.raises(WeightsFormatError, match="more than one file"):  # a link inside is fine
        map_safetensors(root / "v1", root)
    (root / "v1" / "link.safetensors").unlink()
    os.link(root / "v1" / "real.safetensors", outside / "hard.safetensors")  # the same file out
    with pytest.raises(WeightsOutsideRoot, match="2 hard links") as refused:
        map_safetensors(root / "v1", root)
    assert str(root) not in str(refused.value)  # no absolute path of the root in a message
    (outside / "hard.safetensors").unlink()
    assert torch.equal(map_safetensors(root / "v1", root)["w"], torch.ones(2))
    (root / "v1" / "real.safetensors").unlink()
    os.mkfifo(root / "v1" / "pipe.safetensors")  # opening it must not hang
    with pytest.raises(WeightsFormatError, match="not a regular file"):
        map_safetensors(root / "v1", root)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_refused(tmp_path: Path) -> None:
    (tmp_path / "v1").mkdir()
    save_file({"w": torch.ones(2)}, tmp_path / "v1" / "model.safetensors")
    os.chown(tmp_path / "v1" / "model.safetensors", 12345, 12345)
    with pytest.raises(WeightsOutsideRoot, match="another user"):
        map_safetensors(tmp_path / "v1", tmp_path)


def test_check_weights_against_the_model(tmp_path: Path) -> None:
    expected = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    check_weights({"a": torch.ones(2, 3), "b": torch.ones(4)}, expected, "v1")
    with pytest.raises(WeightsFormatError, match="missing tensors"):
        check_weights({"a": torch.ones(2, 3)}, expected, "v1")
    with pytest.raises(WeightsFormatError, match="unexpected tensors"):
        check_weights(
            {"a": torch.ones(2, 3), "b": torch.ones(4), "c": torch.ones(1)}, expected, "v1"
        )
    with pytest.raises(WeightsFormatError, match="shape"):
        check_weights({"a": torch.ones(3, 2), "b": torch.ones(4)}, expected, "v1")
    for bad in (float("nan"), float("inf"), float("-inf")):
        b = torch.ones(4)
        b[2] = bad
        with pytest.raises(NonFiniteWeights, match="b holds NaN or inf"):
            check_weights({"a": torch.ones(2, 3), "b": b.to(torch.bfloat16)}, expected, "v1")
    tied = torch.zeros(5)
    check_weights({"emb": torch.ones(5)}, {"emb": tied, "head": tied}, "v1")  # tied: one is enough


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_non_finite_finds_every_nan_and_inf_and_no_overflowing_finite_sum(dtype: torch.dtype) -> None:
    """The fast path sums each tensor: a finite sum clears it, a non-finite one (which
    finite values can give by overflowing) is checked element by element."""
    big = torch.finfo(dtype).max
    huge = {"a": torch.full((4,), big, dtype=dtype), "b": torch.full((3,), -big, dtype=dtype)}
    assert non_finite(huge) is None  # the sums overflow to +-inf, every value is finite
    assert non_finite({"ids": torch.arange(5)}) is None  # integers are never checked
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 2, 5000):
            tensor = torch.zeros(6000, dtype=dtype)
            tensor[at] = bad
            assert non_finite({"ok": torch.ones(3, dtype=dtype), "w": tensor}) == "w", (bad, at)
    both = torch.zeros(10, dtype=dtype)
    both[1], both[2] = float("inf"), float("-inf")  # sum NaN
    assert non_finite({"w": both}) == "w"


# --------------------------------------------------------------------------- the seal


def _sealed(folder: Path) -> dict[str, torch.Tensor]:
    from mempo.files import atomic_dir
    from mempo.weights import seal, write_safetensors

    tensors = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    with atomic_dir(folder) as tmp:  # as the learner publishes: sealed, then renamed
        write_safetensors(tensors, tmp / "model.safetensors")
        os.chmod(tmp / "model.safetensors", 0o644)
        seal(tmp)
    return tensors


def _poison_in_place(file: Path) -> None:
    """One NaN over the last float's bytes: same size, same inode."""
    with file.open("r+b") as handle:
        handle.seek(-4, os.SEEK_END)
        handle.write(struct.pack("<f", float("nan")))


def test_a_sealed_folder_is_loaded_without_a_finite_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mempo import weights

    tensors = _sealed(tmp_path / "v1")
    scans = []
    monkeypatch.setattr(weights, "non_finite", lambda state: scans.append(1))
    state = weights.load_checked(tmp_path / "v1", tensors, tmp_path)
    assert not scans and all(torch.equal(state[k], v) for k, v in tensors.items())
    (tmp_path / "v1" / weights.SEAL).unlink()  # no seal: every byte is scanned
    weights.load_checked(tmp_path / "v1", tensors, tmp_path)
    assert scans == [1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_write_checks_finite_values_while_it_writes(tmp_path: Path, bad: float) -> None:
    from mempo.weights import write_safetensors

    tensors = {"a": torch.randn(3), "w": torch.randn(70_000)}
    write_safetensors(tensors, tmp_path / "ok.safetensors", finite=True)  # finite: written
    assert torch.equal(load_file(tmp_path / "ok.safetensors")["w"], tensors["w"])
    tensors["w"][12_345] = bad
    with pytest.raises(NonFiniteWeights, match="w holds NaN or inf"):
        write_safetensors(tensors, tmp_path / "bad.safetensors", finite=True)
    write_safetensors(tensors, tmp_path / "unchecked.safetensors")  # the check is opt-in


def test_is_sealed_only_for_the_files_as_sealed(tmp_path: Path) -> None:
    from mempo.weights import SEAL, is_sealed

    _sealed(tmp_path / "v1")
    assert is_sealed(tmp_path / "v1")
    time.sleep(0.02)  # before Linux 6.13 a file's times move by the jiffy (mempo.weights.seal)
    (tmp_path / "v1" / "model.safetensors").chmod(0o600)  # even a chmod breaks it
    assert not is_sealed(tmp_path / "v1")
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / SEAL).write_text('{"files": {}}')  # a seal of no file seals nothing
    assert not is_sealed(tmp_path / "v2")


@pytest.mark.parametrize("change", ["written after", "copied", "seal garbled", "seal of another"])
def test_a_seal_that_does_not_match_the_files_is_ignored_and_nan_refused(
    tmp_path: Path, change: str
) -> None:
    import shutil

    from mempo.weights import SEAL, load_checked

    tensors = _sealed(tmp_path / "v1")
    folder = tmp_path / "v1"
    if change == "copied":  # a copy keeps the seal's text but not the files' identity
        shutil.copytree(folder, tmp_path / "v2")
        folder = tmp_path / "v2"
    elif change == "seal garbled":
        (folder / SEAL).write_text("{not json")
    elif change == "seal of another":
        _sealed(tmp_path / "v2")
        (folder / SEAL).write_text((tmp_path / "v2" / SEAL).read_text())
    time.sleep(0.02)  # before Linux 6.13 a file's times move by the jiffy (mempo.weights.seal)
    _poison_in_place(folder / "model.safetensors")
    with pytest.raises(NonFiniteWeights, match=r"[bw] holds NaN"):
        load_checked(folder, tensors, tmp_path)


# In a child process: a view of a mapped file that was truncated is a SIGBUS, which must
# fail the test, not end pytest.
_REWRITE_AND_TRUNCATE = """
import os, sys, torch
from pathlib import Path
from mempo.weights import load_checked
folder, root = Path(sys.argv[1]), Path(sys.argv[2])
expected = torch.load(folder.parent / "expected.pt")
state = load_checked(folder, expected, root)
file = folder / "model.safetensors"
with file.open("r+b") as handle:  # every byte after the 8-byte length: header and data
    handle.seek(8)
    handle.write(b"\\xff" * (file.stat().st_size - 8))
assert all(torch.equal(state[k], v) for k, v in expected.items()), "rewritten"
os.truncate(file, 0)
assert all(torch.equal(state[k], v) for k, v in expected.items()), "truncated"
print("same")
"""


def test_loaded_tensors_own_their_memory(tmp_path: Path) -> None:
    """``load_checked``'s tensors are no view of the file: rewriting it in place and then
    truncating it changes none of them (a sealed folder: no scan touches them first)."""
    import subprocess
    import sys

    tensors = _sealed(tmp_path / "v1")
    torch.save(tensors, tmp_path / "expected.pt")
    proc = subprocess.run(
        [sys.executable, "-c", _REWRITE_AND_TRUNCATE, str(tmp_path / "v1"), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "same", (proc.returncode, proc.stderr)


@pytest.mark.parametrize("change", ["truncated", "rewritten"])
def test_a_file_changed_while_being_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """Truncated between its header and its data: refused (no SIGBUS, a format error).
    Rewritten in place meanwhile: its seal no longer counts, so its NaN is found."""
    from mempo import weights

    tensors = _sealed(tmp_path / "v1")
    file = tmp_path / "v1" / "model.safetensors"
    read_header = weights._read_header

    def then_change(handle: object, path: Path, size: int) -> tuple[dict[str, object], int]:
        header = read_header(handle, path, size)
        time.sleep(0.02)  # before Linux 6.13 a file's times move by the jiffy
        if change == "truncated":
            os.truncate(file, size - 4)
        else:
            _poison_in_place(file)
        return header

    monkeypatch.setattr(weights, "_read_header", then_change)
    error = WeightsFormatError if change == "truncated" else NonFiniteWeights
    with pytest.raises(error, match=r"truncated while being read|holds NaN"):
        weights.load_checked(tmp_path / "v1", tensors, tmp_path)


def test_own_tensors_copies_a_model_out_of_its_mapped_file(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """transformers maps the file and its float32 parameters view it; after own_tensors a
    rewrite of the file in place changes nothing, and tied weights stay tied."""
    import shutil

    from transformers import AutoModelForCausalLM

    from mempo.model_weights import own_tensors

    shutil.copytree(tiny_model_dir, tmp_path / "m")  # never the shared fixture's files
    model: Any = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    own_tensors(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with (tmp_path / "m" / "model.safetensors").open("r+b") as handle:
        handle.seek(8)
        handle.write(b"\xff" * ((tmp_path / "m" / "model.safetensors").stat().st_size - 8))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_module_tree_copy_takes_new_weights_and_leaves_the_model_alone(
    tiny_model_dir: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    from mempo.model_weights import assign_weights, module_tree_copy

    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    other: Any = module_tree_copy(model)
    assert other.config is model.config  # attributes and buffers shared, not copied
    assert all(a is b for a, b in zip(other.buffers(), model.buffers(), strict=True))
    new = {k: v + 0.01 for k, v in before.items() if k != "lm_head.weight"}
    assign_weights(other, new)
    state = other.state_dict()
    assert all(torch.equal(state[k], new[k]) for k in new)
    assert other.lm_head.weight is other.model.embed_tokens.weight  # re-tied in the copy
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)
        assert not torch.allclose(other(input_ids=ids).logits, logits)


def test_a_forked_child_checks_on_a_thread_of_its_own(tmp_path: Path) -> None:
    """The check's kept thread does not exist in a forked child: it must start its own."""
    import multiprocessing

    from mempo.weights import write_safetensors

    tensors = {"w": torch.randn(100)}
    write_safetensors(tensors, tmp_path / "parent.safetensors", finite=True)  # thread started
    child = multiprocessing.get_context("fork").Process(
        target=write_safetensors,
        args=(tensors, tmp_path / "child.safetensors"),
        kwargs={"finite": True},
    )
    child.start()
    child.join(timeout=30)
    if child.is_alive():  # it waits forever for the parent's thread
        child.kill()
    assert child.exitcode == 0 and (tmp_path / "child.safetensors").exists()
