"""`mempo rollout ...` commands (heavy imports stay inside the commands)."""

from __future__ import annotations

import typer

from mempo.options import SETTINGS_ARGS

app = typer.Typer(help="The rollout service.", no_args_is_help=True)


@app.command("worker", context_settings=SETTINGS_ARGS)
def worker(ctx: typer.Context) -> None:
    """Serve a rollout worker: its HTTP API, and the Redis consumer loop in the background.

    Every setting is an option (--engine-url, --redis-url '' for HTTP only, ...; --help
    lists them) and a MEMPO_ROLLOUT_<NAME> variable; options win."""
    from mempo.options import settings_from_args
    from mempo.settings import quiet_hub, serve
    from services.rollout.app import create_app
    from services.rollout.settings import WorkerSettings

    settings = settings_from_args(WorkerSettings, ctx.args, "mempo rollout worker")
    quiet_hub()
    serve(create_app(settings), settings)


@app.command("engine", context_settings=SETTINGS_ARGS)
def engine(ctx: typer.Context) -> None:
    """Serve the CPU engine: SGLang's native HTTP API, backed by transformers.

    Every setting is an option (--model-path, --weights-root, ...; --help lists them) and
    a MEMPO_ENGINE_<NAME> variable; options win."""
    from mempo.options import settings_from_args
    from mempo.settings import quiet_hub, serve
    from services.rollout.engine.app import create_app
    from services.rollout.engine.settings import EngineSettings

    settings = settings_from_args(EngineSettings, ctx.args, "mempo rollout engine")
    quiet_hub()
    serve(create_app(settings), settings)
