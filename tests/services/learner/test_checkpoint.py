"""Checkpoints: atomic, retained, resumable exactly; HF exports (services/learner/checkpoint.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mempo.weights import SEAL, NonFiniteWeights, is_sealed
from services.learner import checkpoint
from services.learner.step import train_step
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from tests.conftest import REPO
from tests.services.learner.factories import cached_groups

CONFIG = TrainerConfig(lr=1e-3, warmup_steps=3, mini_batches=2, keep_last=2)

# Runs step 1, checkpoints it, runs step 2 and dies while writing step 2's checkpoint:
# after every file is in the temp folder, before the rename (the last moment it could).
CRASHING_RUN = textwrap.dedent(
    """
    import os, sys, torch
    torch.set_num_threads(1)
    from pathlib import Path
    from mempo import files
    from mempo.schemas import Group
    from services.learner.checkpoint import resume_trainer, save_trainer
    from services.learner.step import train_step
    from services.learner.trainer_config import TrainerConfig

    config = TrainerConfig.model_validate_json(sys.argv[1])
    model, root, data = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    steps = [[Group.model_validate_json(line) for line in part.splitlines()]
             for part in data.read_text().split("\\n\\n")]
    trainer, state = resume_trainer(config, model, root)
    assert state is None
    train_step(trainer, steps[0])
    save_trainer(trainer, root, [g.group_id for g in steps[0]], {"admitted": 8})
    train_step(trainer, steps[1])
    real_fsync = files._fsync
    def crash(path, flags):
        real_fsync(path, flags)
        if path.name.startswith(".tmp-step-"):  # the temp folder, whole, not yet renamed
            os._exit(17)
    files._fsync = crash
    save_trainer(trainer, root, [g.group_id for g in steps[1]])
    """
)


def params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}


def test_resume_after_a_crash_equals_an_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    first = cached_groups(tiny_model_dir, 2)
    second = cached_groups(tiny_model_dir, 2, seed=10)
    data = tmp_path / "groups.jsonl"
    data.write_text(
        "\n\n".join(
            "\n".join(g.model_dump_json(context={"pack": True}) for g in part)
            for part in (first, second)
        )
    )
    root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            CRASHING_RUN,
            CONFIG.model_dump_json(),
            str(tiny_model_dir),
            str(root),
            str(data),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 17, run.stderr[-3000:]
    assert [
        p.name for p in root.iterdir() if p.name.startswith(".tmp-step-")
    ]  # the half-written one
    assert checkpoint.latest(root) == root / "step-00000001"

    resumed, state = checkpoint.resume_trainer(CONFIG, tiny_model_dir, root)
    assert state is not None
    assert (state.step, state.version, state.extra) == (1, 1, {"admitted": 8})
    assert state.trained_group_ids == [g.group_id for g in first]
    assert (resumed.step, resumed.version, resumed.optimizer_steps) == (1, 1, 2)
    train_step(resumed, second)

    straight = Trainer(CONFIG, tiny_model_dir)
    train_step(straight, first)
    train_step(straight, second)
    got, want = params(resumed), params(straight)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert resumed.scheduler.get_last_lr() == straight.scheduler.get_last_lr()
    # the reference stays the initial policy, not the checkpoint
    assert resumed.ref is not None and straight.ref is not None
    for (name, p), q in zip(resumed.ref.named_parameters(), straight.ref.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_retention_and_atomicity(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer(TrainerConfig(beta_kl=0.0, keep_last=2), tiny_model_dir)
    (tmp_path / ".tmp-step-9-stale").mkdir(parents=True)  # left by an earlier crash
    (tmp_path / "step-00000007").mkdir()  # no meta.json: never complete, never listed
    saved = []
    for step in range(3):
        trainer.step = trainer.version = step
        saved.append(checkpoint.save_trainer(trainer, tmp_path, [f"g{step}"]))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-00000001", "step-00000002", "step-00000007"]
    assert checkpoint.latest(tmp_path) == saved[-1]
    assert checkpoint.read_meta(saved[-1]).trained_group_ids == ["g2"]
    with pytest.raises(TypeError):
        checkpoint.save_trainer(trainer, tmp_path, [], {"not json": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == names


def test_a_non_finite_policy_is_never_checkpointed(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Retention would delete the last good checkpoint a few steps after a NaN one."""
    trainer = Trainer(TrainerConfig(beta_kl=0.0, keep_last=1), tiny_model_dir)
    good = checkpoint.save_trainer(trainer, tmp_path, ["g0"])
    with torch.no_grad():
        next(trainer.policy.parameters()).view(-1)[0] = float("nan")
    trainer.step = trainer.version = 1
    with pytest.raises(NonFiniteWeights, match="NaN or inf"):
        checkpoint.save_trainer(trainer, tmp_path, ["g0", "g1"])
    assert [p.name for p in tmp_path.iterdir()] == [good.name]
    assert checkpoint.latest(tmp_path) == good


def test_a_non_finite_policy_is_never_exported(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The export checks the tensors as it writes them (and then seals what it checked)."""
    trainer = Trainer(TrainerConfig(beta_kl=0.0), tiny_model_dir)
    assert is_sealed(checkpoint.export_trainer(trainer, tmp_path / "v0"))
    with torch.no_grad():
        next(trainer.policy.parameters()).view(-1)[0] = float("inf")
    with pytest.raises(NonFiniteWeights, match="NaN or inf"):
        checkpoint.export_trainer(trainer, tmp_path / "v1")
    assert not (tmp_path / "v1" / SEAL).exists()


def test_resume_without_a_checkpoint_starts_fresh(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer, state = checkpoint.resume_trainer(
        TrainerConfig(beta_kl=0.0), tiny_model_dir, tmp_path / "none"
    )
    assert state is None and trainer.step == trainer.version == 0


def test_export_hf_loads_as_the_same_policy(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = Trainer(TrainerConfig(lr=1e-3, beta_kl=0.0), tiny_model_dir)
    train_step(trainer, cached_groups(tiny_model_dir, 1))
    out = checkpoint.export_trainer(trainer, tmp_path / "v1")
    for path in [out, *out.iterdir()]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o444 == 0o444, path  # world-readable
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
    assert "lm_head.weight" not in keys  # tied to the embeddings, re-tied on load
    in_memory = checkpoint.trainer_tensors(trainer)  # what a weight broadcast sends
    on_disk = load_file(str(out / "model.safetensors"))
    assert set(in_memory) == keys and all(torch.equal(in_memory[k], on_disk[k]) for k in keys)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer.encode("<mem>Q1: ?</mem><think>", add_special_tokens=False)])
    trainer.policy.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, trainer.policy(input_ids=ids).logits
        )
    bf16_trainer = Trainer(TrainerConfig(beta_kl=0.0, export_dtype="bfloat16"), tiny_model_dir)
    bf16 = checkpoint.export_trainer(bf16_trainer, tmp_path / "bf")
    assert json.loads((bf16 / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16
