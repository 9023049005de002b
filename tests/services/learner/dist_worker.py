"""Run under torchrun by test_distributed.py: rank 0 drives, the other ranks follow.

    torchrun --nproc_per_node 2 dist_worker.py CONFIG_JSON MODEL_DIR GROUPS_JSONL OUT_DIR

Rank 0 trains one step on the groups, checkpoints, exports HF weights and writes the
step's metrics to OUT_DIR/metrics.json; every collective runs on all ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from mempo.schemas import Group
from services.learner.checkpoint import export_trainer, save_trainer
from services.learner.step import follow, train_step
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig


def main() -> None:
    torch.set_num_threads(1)
    config = TrainerConfig.model_validate_json(sys.argv[1])
    model_dir, data, out = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    trainer = Trainer(config, model_dir)
    if not trainer.dist.is_main:
        follow(trainer)
        trainer.close()
        return
    groups = [Group.model_validate_json(line) for line in data.read_text().splitlines()]
    metrics = train_step(trainer, groups)
    save_trainer(
        trainer, out / "ckpt", [g.group_id for g in groups], {"world": trainer.dist.world_size}
    )
    export_trainer(trainer, out / "hf")
    (out / "metrics.json").write_text(
        json.dumps({"step": metrics, "minibatches": trainer.minibatch_metrics})
    )
    trainer.close()


if __name__ == "__main__":
    main()
