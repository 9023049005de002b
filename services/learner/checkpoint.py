"""Checkpoints (atomic, retained, resumable) and HF-format exports of the policy.

A checkpoint is a folder ``step-{step:08d}/`` under the root:

    model.pt       the policy's full state dict
    optimizer.pt   AdamW state keyed by parameter name (loads into any sharding)
    trainer.pt     LR scheduler state, torch (and CUDA) RNG states
    meta.json      step, version, trained group ids, python / numpy RNG, free-form extra

It is written into a temp folder, every file fsynced, then renamed into place (and the
root fsynced), so a crash at any point leaves either the complete checkpoint or none:
``latest()`` never sees half of one. Older checkpoints beyond ``keep_last`` are deleted
only after the new one is durable. The learner acks the groups it trained on only after
``save`` returns, so with the ids in ``meta.json`` every group is trained exactly once.

The functions over a whole ``Trainer`` (``save_trainer``, ``export_trainer``,
``restore_trainer``) are collective under torchrun: on rank 0 each first sends its
command to the other ranks, which run the same function from ``step.follow``.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mempo.files import atomic_dir
from mempo.weights import check_finite, seal, write_safetensors
from mempo_sim.tiny import make_world_readable
from services.learner.distributed import (
    full_model_state,
    full_optimizer_state,
    lead,
    load_full_state,
)
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step-(\d{8,})")
_TEMP_PREFIX = ".tmp-step-"
FORMAT = 1
_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack)$|.*\.index\.json$")


@dataclass
class CheckpointState:
    """What a checkpoint records besides tensors."""

    step: int
    version: int
    trained_group_ids: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


@dataclass
class TrainingState:
    """Everything needed to continue training exactly where it stopped."""

    meta: CheckpointState
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]


# --------------------------------------------------------------------------- RNG


def capture_rng() -> dict[str, Any]:
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    rng: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],  # type: ignore[index,misc]
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    py_version, py_state, py_gauss = rng["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


# --------------------------------------------------------------------------- save / load


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.fullmatch(p.name)) and (p / "meta.json").is_file()
    ]
    return sorted(found)


def save(root: Path, state: TrainingState, keep_last: int) -> Path:
    """Write ``state`` atomically as ``root/step-{step:08d}``; apply retention.

    A policy with a NaN or inf weight is refused (NonFiniteWeights) before anything is
    written: retention would otherwise delete the last good checkpoint a few steps later."""
    meta = state.meta
    check_finite(state.model, f"the policy of step {meta.step}")
    root.mkdir(parents=True, exist_ok=True)
    python_rng = {k: state.rng[k] for k in ("python", "numpy")}
    meta_json = json.dumps(
        {
            "format": FORMAT,
            "step": meta.step,
            "version": meta.version,
            "trained_group_ids": list(meta.trained_group_ids),
            "extra": meta.extra,
            "rng": python_rng,
            "saved_at": time.time(),
        }
    )  # fails here, before anything is written, if extra is not JSON
    final = root / f"step-{meta.step:08d}"  # the same step saved again (a retry): replaced
    with atomic_dir(final, prefix=f"{_TEMP_PREFIX}{meta.step}-", durable=True) as tmp:
        torch.save(state.model, tmp / "model.pt")
        torch.save(state.optimizer, tmp / "optimizer.pt")
        torch_rng = {k: v for k, v in state.rng.items() if k not in python_rng}
        torch.save({"scheduler": state.scheduler, "rng": torch_rng}, tmp / "trainer.pt")
        (tmp / "meta.json").write_text(meta_json)
    _retain(root, keep_last)
    log.info("checkpoint step %s (version %s) saved to %s", meta.step, meta.version, final)
    return final


def _retain(root: Path, keep_last: int) -> None:
    for _, path in step_dirs(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(f"{_TEMP_PREFIX}*"):  # left by a crash mid-save
        shutil.rmtree(path, ignore_errors=True)


def read_meta(path: Path) -> CheckpointState:
    data = json.loads((path / "meta.json").read_text())
    return CheckpointState(
        step=int(data["step"]),
        version=int(data["version"]),
        trained_group_ids=list(data.get("trained_group_ids", [])),
        extra=dict(data.get("extra", {})),
        path=path,
    )


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint whose metadata reads, or None."""
    for _, path in reversed(step_dirs(root)):
        try:
            read_meta(path)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("skipping unreadable checkpoint %s: %s", path, exc)
            continue
        return path
    return None


def load(path: Path) -> TrainingState:
    meta = read_meta(path)
    rng = json.loads((path / "meta.json").read_text())["rng"]
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    return TrainingState(
        meta=meta,
        model=torch.load(path / "model.pt", weights_only=True),
        optimizer=torch.load(path / "optimizer.pt", weights_only=True),
        scheduler=trainer["scheduler"],
        rng={**rng, **trainer["rng"]},
    )


# --------------------------------------------------------------------------- HF export


def tied_parameter_names(model: torch.nn.Module) -> frozenset[str]:
    """Names under which an already-listed parameter appears again (tied embeddings)."""
    unique = {name for name, _ in model.named_parameters()}
    return frozenset(name for name, _ in model.named_parameters(remove_duplicate=False)) - unique


def export_tensors(
    state: dict[str, torch.Tensor], dtype: torch.dtype | None, tied: frozenset[str]
) -> dict[str, torch.Tensor]:
    """The tensors an export holds: in ``dtype`` (None: as they are), contiguous, without
    the ``tied`` names (HF re-ties them on load; safetensors refuses shared storage)."""
    return {
        name: (t.to(dtype) if dtype is not None else t).contiguous()
        for name, t in state.items()
        if name not in tied
    }


def export_hf(
    state: dict[str, torch.Tensor],
    config: Any,
    base_dir: Path,
    out_dir: Path,
    dtype: torch.dtype | None = None,
    tied: frozenset[str] = frozenset(),
) -> Path:
    """Write an HF folder: model.safetensors, config.json and the base model's other files.

    ``tied`` names parameters that alias another (tied embeddings): HF re-ties them on
    load, and safetensors refuses shared storage, so they are left out. The tensors are
    checked finite while they are written (``NonFiniteWeights``: write into a temporary
    folder); the folder is made world-readable (engines in other containers load it) and
    sealed (mempo.weights.seal: its receivers need not scan it again).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in base_dir.iterdir():  # tokenizer, generation config, ...
        if item.is_file() and not _WEIGHT_FILES.fullmatch(item.name) and item.name != "config.json":
            shutil.copy2(item, out_dir / item.name)
    tensors = export_tensors(state, dtype, tied)
    write_safetensors(tensors, out_dir / "model.safetensors", {"format": "pt"}, finite=True)
    config.save_pretrained(out_dir)
    dtype_name = str(dtype or next(iter(tensors.values())).dtype).removeprefix("torch.")
    config_path = out_dir / "config.json"
    data = json.loads(config_path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in data:
            data[key] = dtype_name
    config_path.write_text(json.dumps(data, indent=2))
    make_world_readable(out_dir)
    seal(out_dir)  # last: after the chmod
    return out_dir


# --------------------------------------------------------------------------- a trainer's


def resume_trainer(
    config: TrainerConfig, model_path: str | Path, root: Path, device: str = "cpu"
) -> tuple[Trainer, CheckpointState | None]:
    """A trainer continued from the latest checkpoint under ``root``, if there is one.

    The reference model stays the initial policy at ``model_path``.
    """
    trainer = Trainer(config, model_path, device)
    path = latest(Path(root))
    return trainer, (load_trainer(trainer, path) if path is not None else None)


def save_trainer(
    trainer: Trainer,
    root: Path,
    trained_group_ids: list[str],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Checkpoint everything needed to resume ``trainer`` (collective under torchrun:
    every rank gathers; rank 0 writes)."""
    extra = dict(extra or {})
    lead(trainer.dist, "save", (str(root), list(trained_group_ids), extra))
    root = Path(root)
    model_state = full_model_state(trainer.policy, trainer.dist)
    optimizer_state = full_optimizer_state(trainer.policy, trainer.optimizer, trainer.dist)
    path = root / f"step-{trainer.step:08d}"
    if trainer.dist.is_main:
        state = TrainingState(
            meta=CheckpointState(trainer.step, trainer.version, list(trained_group_ids), extra),
            model=model_state,
            optimizer=optimizer_state,
            scheduler={
                **trainer.scheduler.state_dict(),
                "optimizer_steps": trainer.optimizer_steps,
            },
            rng=capture_rng(),
        )
        path = save(root, state, trainer.config.keep_last)
    if trainer.dist.sharded:
        torch.distributed.barrier()
    return path


def load_trainer(trainer: Trainer, path: Path) -> CheckpointState:
    """Restore weights, optimizer, schedule, RNG and counters from ``path`` (every rank)."""
    state = load(path)
    load_full_state(trainer.policy, trainer.optimizer, state.model, state.optimizer)
    scheduler = dict(state.scheduler)
    trainer.optimizer_steps = int(scheduler.pop("optimizer_steps", 0))
    trainer.scheduler.load_state_dict(scheduler)
    restore_rng(state.rng)
    trainer.step, trainer.version = state.meta.step, state.meta.version
    log.info("resumed from %s (step %s, version %s)", path, trainer.step, trainer.version)
    return state.meta


def restore_trainer(trainer: Trainer, root: Path) -> None:
    """Undo a failed step: back to the latest checkpoint under ``root`` (every step
    checkpoints, so it is the state before the step) or, before the first one, to the
    initial state (collective under torchrun)."""
    lead(trainer.dist, "restore", str(root))
    path = latest(Path(root))
    if path is not None:
        load_trainer(trainer, path)
        return
    if trainer.step != 0:
        raise RuntimeError(f"cannot undo step {trainer.step + 1}: no checkpoint under {root}")
    trainer.reset()


def export_trainer(trainer: Trainer, out_dir: Path) -> Path:
    """The policy as an HF folder: safetensors, config, tokenizer files (collective under
    torchrun: rank 0 writes)."""
    lead(trainer.dist, "export", str(out_dir))
    out_dir = Path(out_dir)
    state = full_model_state(trainer.policy, trainer.dist)
    if trainer.dist.is_main:
        tied = tied_parameter_names(trainer.policy)
        export_hf(
            state, trainer.policy.config, trainer.model_path, out_dir, _export_dtype(trainer), tied
        )
    if trainer.dist.sharded:
        torch.distributed.barrier()
    return out_dir


def trainer_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The tensors ``export_trainer`` writes, in memory (what a weight broadcast sends).
    Unsharded trainers only: a sharded one exports through ``export_trainer``."""
    if trainer.dist.sharded:
        raise RuntimeError("a sharded trainer publishes through export_trainer (disk) only")
    state = full_model_state(trainer.policy, trainer.dist)
    return export_tensors(state, _export_dtype(trainer), tied_parameter_names(trainer.policy))


def _export_dtype(trainer: Trainer) -> torch.dtype | None:
    return getattr(torch, trainer.config.export_dtype) if trainer.config.export_dtype else None


@dataclass(frozen=True)
class TrainerExporter:
    """A trainer as the publisher's ``WeightExporter``: its policy written as an HF folder,
    or held in memory for a weight broadcast."""

    trainer: Trainer

    def export_hf(self, out_dir: Path) -> Path:
        return export_trainer(self.trainer, out_dir)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        return trainer_tensors(self.trainer)
