"""The default policy of ``mempo up``: the tiny model, SFT warm-started once and cached."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from mempo.files import atomic_dir
from mempo_sim.tiny import PRESETS, default_cache_dir, ensure_tiny


@dataclass(frozen=True)
class WarmStart:
    """What ``mempo sft`` is run with; the cache key of the result."""

    preset: str = "reader"  # pretrained on reading drills (mempo_sim/pretrain.py)
    tasks: int = 128  # oracle tasks per world and number of questions
    worlds: int = 8  # the agent's world (train split) and the next 7
    world_seed: int = 0  # the agent's world
    k: str = "1,2"
    mode: str = "memory"
    steps: int = 300
    lr: float = 2e-3
    copy_weight: float = 1.0  # loss weight of the copied values (mempo sft --copy-weight)
    seed: int = 0

    def key(self, base: Path) -> str:
        spec = json.dumps({**asdict(self), "base": base.name}, sort_keys=True)
        return hashlib.sha256(spec.encode()).hexdigest()[:12]


def sft_command(spec: WarmStart, base: Path, out: Path) -> list[str]:
    """``mempo sft`` of ``base`` into ``out`` with the warm start's recipe."""
    return [
        sys.executable, "-m", "mempo_cli", "sft", "--out", str(out), "--model", str(base),
        "--tasks", str(spec.tasks), "--worlds", str(spec.worlds), "--world-seed", str(spec.world_seed),
        "--k", spec.k, "--mode", spec.mode, "--steps", str(spec.steps), "--lr", str(spec.lr),
        "--copy-weight", str(spec.copy_weight), "--seed", str(spec.seed),
    ]  # fmt: skip


def warm_started_policy(spec: WarmStart, cache_dir: Path | None = None) -> Path:
    """Build the tiny model and SFT it (shown live), unless the result is cached."""
    cache = cache_dir or default_cache_dir()
    base = ensure_tiny(cache, PRESETS[spec.preset])
    final = cache / "sft" / f"sft-{spec.key(base)}"
    if (final / "model.safetensors").exists():
        return final
    print(f"[mempo] SFT warm start of the tiny model ({spec.steps} steps, once; cached in {final})", flush=True)
    with atomic_dir(final) as tmp:
        subprocess.run(sft_command(spec, base, tmp), check=True)
    return final
