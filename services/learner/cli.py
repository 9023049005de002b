"""`mempo learner ...` commands (heavy imports stay inside the commands)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from mempo.options import SETTINGS_ARGS
from mempo.settings import fail

app = typer.Typer(help="The learner service.", no_args_is_help=True)


@app.command("serve", context_settings=SETTINGS_ARGS)
def serve_learner(ctx: typer.Context) -> None:
    """Serve the learner: the training loop in the background, its status over HTTP.

    Every setting is an option (--model-path, --run-dir, --total-steps, ...; --help lists
    them) and a MEMPO_LEARNER_<NAME> variable, options winning; the trainer's only as
    MEMPO_LEARNER_TRAINER__<FIELD>. Exits 1 when the training loop failed. Under torchrun
    (WORLD_SIZE > 1) rank 0 serves and drives the loop; the other ranks follow."""
    from mempo.options import settings_from_args
    from mempo.settings import quiet_hub, serve
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


def _backend_names(value: Any) -> Any:
    from mempo.tracking import backend_names

    return backend_names(value)


def _parse_ks(value: Any) -> Any:
    from services.learner.settings import parse_ks

    return parse_ks(value) if isinstance(value, (str, int)) else value


class SftCommand(BaseModel):
    """``mempo sft``'s options besides the training's own (SftConfig's fields)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    out: Path
    """Output folder: an HF checkpoint usable as the policy."""

    model: str | None = None
    """Base model folder (default: the tiny model)."""

    data: Path | None = None
    """jsonl of rendered rounds (default: oracle trajectories)."""

    tasks: int = Field(default=64, ge=1)
    """Oracle tasks per mode."""

    k: Annotated[list[int], BeforeValidator(_parse_ks)] = [1]
    """Questions per task: "2", "1,2,4" or "1-3" (--tasks of each; "1,2,2": twice as many of 2)."""

    mode: Literal["memory", "full", "both"] = "memory"
    """memory | full | both."""

    world_seed: int = 0
    """Seed of the synthetic world."""

    worlds: int = Field(default=1, ge=1)
    """Oracle data from this many worlds (seeds world_seed, +1, ...)."""

    memory_subjects: bool = False
    """The oracle's memory keeps each open question's subject (Q2: Roqua > ?)."""

    device: str = "cpu"
    """Torch device."""

    track: Annotated[list[str], BeforeValidator(_backend_names)] = []
    """Log the loss every logged step: jsonl (run_dir/metrics.jsonl) and any of tensorboard,
    wandb, mlflow, comma separated."""

    run_dir: Path | None = None
    """Folder of the run's metrics.jsonl and trackers' files (given, or with --track:
    default <out>-run beside the checkpoint; neither: no tracking, the log only)."""

    @field_validator("k")
    @classmethod
    def _check_k(cls, ks: list[int]) -> list[int]:
        if not ks or not all(1 <= n <= 64 for n in ks):
            raise ValueError(f"every number of questions must be 1..64 (got {ks})")
        return ks

    @field_validator("track")
    @classmethod
    def _check_track(cls, track: list[str]) -> list[str]:
        from mempo.tracking import check_backends

        return check_backends(track) if track else []

    @field_validator("data")
    @classmethod
    def _data_file(cls, data: Path | None) -> Path | None:
        if data is not None and not data.is_file():
            raise ValueError(f"{data} is not a file")
        return data


def sft(ctx: typer.Context) -> None:
    """SFT warm start: train on response tokens only, write an HF checkpoint (--help: every
    option, SftConfig's among them)."""
    import json

    from transformers import AutoTokenizer

    from mempo.options import command_options, read_options, validated
    from mempo.settings import configure_logging, quiet_hub
    from mempo.tracking import Tracker
    from mempo_sim.tiny import default_cache_dir, ensure_tiny
    from services.learner.sft import SftConfig, jsonl_sequences, oracle_sequences, train_sft

    params = command_options(SftCommand) + command_options(SftConfig)
    given = read_options(
        "mempo sft", params, ctx.args, "SFT warm start: train on response tokens only."
    )
    option = lambda where: f"--{where.replace('_', '-')}"  # noqa: E731
    cmd = validated(
        lambda: SftCommand(**{k: v for k, v in given.items() if k in SftCommand.model_fields}),
        option,
    )
    config = validated(
        lambda: SftConfig(**{k: v for k, v in given.items() if k in SftConfig.model_fields}), option
    )
    quiet_hub()
    configure_logging()
    model_path = cmd.model or str(ensure_tiny(default_cache_dir()))
    tok: Any = AutoTokenizer.from_pretrained(model_path)
    try:
        if cmd.data is not None:
            sequences = jsonl_sequences(tok, cmd.data)
        else:
            sequences = oracle_sequences(
                tok,
                cmd.tasks,
                cmd.k,
                cmd.mode,
                cmd.world_seed,
                config.seed,
                cmd.worlds,
                cmd.memory_subjects,
            )
    except ValueError as exc:
        fail(str(exc))
    tracker = None
    if cmd.track or cmd.run_dir:
        run_dir = cmd.run_dir or cmd.out.with_name(f"{cmd.out.name}-run")
        tracker = Tracker(run_dir, cmd.track, f"sft-{cmd.out.name}", given, journal=True, resume=False)
    try:
        report = train_sft(model_path, sequences, cmd.out, config, cmd.device, tracker)
    finally:
        if tracker is not None:
            tracker.close()
    typer.echo(json.dumps({
        "out": str(report.out_dir), "steps": report.steps, "sequences": report.sequences,
        "first_loss": report.first_loss, "last_loss": report.last_loss, "tokens_per_s": report.tokens_per_s,
    }))  # fmt: skip


def register_top_level(root: typer.Typer) -> None:
    """Top-level commands implemented here: ``mempo sft``."""
    root.command("sft", context_settings=SETTINGS_ARGS)(sft)
