"""`mempo learner ...` commands (heavy imports stay inside the commands)."""

from __future__ import annotations

from pathlib import Path

import typer

from mempo.settings import SETTINGS_ARGS

app = typer.Typer(help="The learner service.", no_args_is_help=True)


@app.command("serve", context_settings=SETTINGS_ARGS)
def serve_learner(ctx: typer.Context) -> None:
    """Serve the learner: the training loop in the background, its status over HTTP.

    Every setting is an option (--model-path, --run-dir, --total-steps, ...; --help lists
    them) and a MEMPO_LEARNER_<NAME> variable, options winning; the trainer's only as
    MEMPO_LEARNER_TRAINER__<FIELD>. Exits 1 when the training loop failed. Under torchrun
    (WORLD_SIZE > 1) rank 0 serves and drives the loop; the other ranks follow."""
    from mempo.settings import quiet_hub, serve, settings_from_args
    from services.learner.app import create_app
    from services.learner.settings import LearnerSettings

    quiet_hub()
    settings = settings_from_args(LearnerSettings, ctx.args, "mempo learner serve")
    if follower_rank():  # torchrun rank > 0: train rank 0's batches, no Redis, no HTTP
        from mempo.settings import configure_logging
        from services.learner.checkpoint import resume_trainer
        from services.learner.step import follow

        configure_logging(settings.log_level)
        trainer, _ = resume_trainer(
            settings.trainer,
            settings.resolved_model_path(),
            settings.checkpoints,
            settings.resolved_device(),
        )
        follow(trainer)
        trainer.close()
        return
    learner = create_app(settings)
    serve(learner, settings)
    training = getattr(learner.state, "training", None)
    if training is not None and training.state == "failed":
        raise typer.Exit(1)


def follower_rank() -> bool:
    """A torchrun rank other than 0 (WORLD_SIZE > 1, RANK > 0)."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0


def sft(
    out: Path = typer.Option(..., help="output folder: an HF checkpoint usable as the policy"),
    model: str | None = typer.Option(None, help="base model folder (default: the tiny model)"),
    data: Path | None = typer.Option(None, help="jsonl of rendered rounds (default: oracle trajectories)"),
    steps: int | None = typer.Option(None, min=1, help="optimizer steps (default: --epochs passes)"),
    epochs: float = typer.Option(3.0, min=0.01, help="passes over the data when --steps is unset"),
    lr: float = typer.Option(1e-3, min=0.0, help="peak learning rate (1e-5 for 7B-class models)"),
    tasks: int = typer.Option(64, min=1, help="oracle tasks per mode"),
    k: str = typer.Option(
        "1", help='questions per task: "2", "1,2,4" or "1-3" (--tasks of each; "1,2,2": twice as many of 2)'
    ),
    mode: str = typer.Option("memory", help="memory | full | both"),
    seed: int = typer.Option(0, help="data order and task seed"),
    world_seed: int = typer.Option(0, help="seed of the synthetic world"),
    worlds: int = typer.Option(1, min=1, help="oracle data from this many worlds (seeds world_seed, +1, ...)"),
    copy_weight: float = typer.Option(
        1.0, help="loss weight of the <mem>, <search> and <answer> contents (the copied values) against 1"
    ),
    memory_subjects: bool = typer.Option(
        False, "--memory-subjects", help="the oracle's memory keeps each open question's subject (Q2: Roqua > ?)"
    ),
    device: str = typer.Option("cpu", help="torch device"),
) -> None:
    """SFT warm start: train on response tokens only, write an HF checkpoint."""
    import json
    from typing import Any

    from pydantic import ValidationError
    from transformers import AutoTokenizer

    from mempo.settings import configure_logging, fail, quiet_hub
    from mempo_sim.tiny import default_cache_dir, ensure_tiny
    from services.learner.settings import parse_ks
    from services.learner.sft import SftConfig, jsonl_sequences, oracle_sequences, train_sft

    if mode not in ("memory", "full", "both"):
        fail(f"--mode must be memory, full or both (got {mode!r})")
    if data is not None and not data.is_file():
        fail(f"--data {data} is not a file")
    try:
        ks = parse_ks(k)
    except ValueError as exc:
        fail(f"--k: {exc}")
    if not ks or not all(1 <= n <= 64 for n in ks):
        fail(f"--k: every number of questions must be 1..64 (got {k!r})")
    try:
        config = SftConfig(lr=lr, steps=steps, epochs=epochs, seed=seed, copy_weight=copy_weight)
    except ValidationError as exc:
        err = exc.errors()[0]
        fail(f"--{'.'.join(map(str, err['loc']))}: {err['msg']}")
    quiet_hub()
    configure_logging()
    model_path = model or str(ensure_tiny(default_cache_dir()))
    tok: Any = AutoTokenizer.from_pretrained(model_path)
    try:
        sequences = (
            jsonl_sequences(tok, data)
            if data is not None
            else oracle_sequences(tok, tasks, ks, mode, world_seed, seed, worlds, memory_subjects)  # type: ignore[arg-type]
        )
    except ValueError as exc:
        fail(str(exc))
    report = train_sft(model_path, sequences, out, config, device)
    typer.echo(json.dumps({
        "out": str(report.out_dir), "steps": report.steps, "sequences": report.sequences,
        "first_loss": report.first_loss, "last_loss": report.last_loss, "tokens_per_s": report.tokens_per_s,
    }))  # fmt: skip


def register_top_level(root: typer.Typer) -> None:
    """Top-level commands implemented here: ``mempo sft``."""
    root.command("sft")(sft)
