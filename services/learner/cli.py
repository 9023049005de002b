"""`mempo learner ...` commands (heavy imports stay inside the commands)."""

from __future__ import annotations

import typer

app = typer.Typer(help="The learner service.", no_args_is_help=True)


@app.command("serve")
def serve_learner(
    port: int | None = typer.Option(None, help="HTTP port (default 8004, MEMPO_LEARNER_PORT)"),
    host: str | None = typer.Option(None, help="interface to bind (MEMPO_LEARNER_HOST)"),
    redis_url: str | None = typer.Option(None, help="MEMPO_LEARNER_REDIS_URL"),
    model_path: str | None = typer.Option(None, help="initial policy (MEMPO_LEARNER_MODEL_PATH)"),
    run_dir: str | None = typer.Option(
        None, help="metrics.jsonl, checkpoints (MEMPO_LEARNER_RUN_DIR)"
    ),
    weights_root: str | None = typer.Option(
        None, help="published versions (MEMPO_LEARNER_WEIGHTS_ROOT)"
    ),
    total_steps: int | None = typer.Option(
        None, help="0 trains forever (MEMPO_LEARNER_TOTAL_STEPS)"
    ),
) -> None:
    """Serve the learner: the training loop in the background, its status over HTTP.

    Every setting is also read from MEMPO_LEARNER_* environment variables (the trainer's
    as MEMPO_LEARNER_TRAINER__<FIELD>). Exits 1 when the training loop failed. Under
    torchrun (WORLD_SIZE > 1) rank 0 serves and drives the loop; the other ranks follow."""
    from pydantic import ValidationError

    from mempo.cli import fail
    from mempo.settings import quiet_hub, serve
    from services.learner.app import create_app
    from services.learner.settings import LearnerSettings

    quiet_hub()
    given = {
        "port": port,
        "host": host,
        "redis_url": redis_url,
        "model_path": model_path,
        "run_dir": run_dir,
        "weights_root": weights_root,
        "total_steps": total_steps,
    }
    try:
        settings = LearnerSettings(**{k: v for k, v in given.items() if v is not None})  # type: ignore[arg-type]
    except ValidationError as exc:
        err = exc.errors()[0]
        fail(f"{'.'.join(map(str, err['loc']))}: {err['msg']}")
    if follower_rank():
        from services.learner.runner import follow

        follow(settings)  # torchrun rank > 0: train rank 0's batches, no Redis, no HTTP
        return
    learner = create_app(settings)
    serve(learner, settings)
    runner = getattr(learner.state, "runner", None)
    if runner is not None and runner.state == "failed":
        raise typer.Exit(1)


def follower_rank() -> bool:
    """A torchrun rank other than 0 (WORLD_SIZE > 1, RANK > 0)."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) > 0
