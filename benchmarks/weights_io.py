"""Our safetensors code (mempo/weights.py) against the safetensors library, same tensors.

mempo/weights.py writes and reads safetensors by hand; the library is a dependency. Each
must be the faster one in the same run, or go (issue 30). Measured on the medium model's
state dict (27M float32 parameters, 108 MB; page cache warm, median of ``--reps``):

- write: ``write_safetensors`` against ``safetensors.torch.save_file``;
- load: what a receiver of a publish does before it can use the weights: every tensor
  as a torch tensor, then the finite check (``non_finite``, the same for both), ours
  ``map_safetensors`` (memory-mapped, zero-copy, checked inside the weights root)
  against ``safetensors.torch.load_file`` (reads into fresh tensors) and ``safe_open``
  (memory-mapped by the library, a tensor per ``get_tensor``).

Prints one JSON line with the seconds of each and ``write_ratio`` (ours / library),
``load_ratio`` (ours / the faster library way): below 1, ours is faster.

    python benchmarks/weights_io.py [--reps 7]
    python benchmarks/weights_io.py --smoke   # seconds-scale sizes: checks it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mempo.weights import map_safetensors, non_finite, write_safetensors  # noqa: E402


def state_dict(hidden: int, layers: int, vocab: int) -> dict[str, torch.Tensor]:
    """A Qwen2-shaped state dict of random float32 tensors (no model is built)."""
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in {
            "self_attn.q_proj.weight": (hidden, hidden),
            "self_attn.k_proj.weight": (hidden // 2, hidden),
            "self_attn.v_proj.weight": (hidden // 2, hidden),
            "self_attn.o_proj.weight": (hidden, hidden),
            "mlp.gate_proj.weight": (3 * hidden, hidden),
            "mlp.up_proj.weight": (3 * hidden, hidden),
            "mlp.down_proj.weight": (hidden, 3 * hidden),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
        }.items():
            tensors[p + name] = torch.randn(*shape, generator=g)
    tensors["model.norm.weight"] = torch.ones(hidden)
    return tensors


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``reps`` calls (one warm-up call first)."""
    fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def library_mapped(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def checked(load: Callable[[], dict[str, torch.Tensor]]) -> Callable[[], None]:
    def run() -> None:
        if non_finite(load()) is not None:
            raise AssertionError("the benchmark's tensors are finite")

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: checks it runs")
    args = parser.parse_args()
    size = dict(hidden=64, layers=2, vocab=512) if args.smoke else dict(hidden=512, layers=8, vocab=3072)
    reps = 1 if args.smoke else args.reps
    tensors = state_dict(**size)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "ours").mkdir()
        (root / "lib").mkdir()
        ours, lib = root / "ours" / "model.safetensors", root / "lib" / "model.safetensors"
        write_ours = timed(lambda: write_safetensors(tensors, ours), reps)
        write_lib = timed(lambda: save_file(tensors, str(lib)), reps)
        assert all(torch.equal(load_file(str(ours))[k], v) for k, v in tensors.items())  # same bytes read back
        load_ours = timed(checked(lambda: map_safetensors(root / "ours", root)), reps)
        load_lib = timed(checked(lambda: load_file(str(lib))), reps)
        load_lib_mapped = timed(checked(lambda: library_mapped(lib)), reps)
        size_mb = ours.stat().st_size / 1e6
    print(json.dumps({
        "mb": round(size_mb, 1),
        "write_ours_s": write_ours, "write_library_s": write_lib, "write_ratio": write_ours / write_lib,
        "load_ours_s": load_ours, "load_library_s": load_lib, "load_library_mapped_s": load_lib_mapped,
        "load_ratio": load_ours / min(load_lib, load_lib_mapped),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
