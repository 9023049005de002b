"""`mempo rollout ...` commands (heavy imports stay inside the commands)."""

from __future__ import annotations

from typing import Any

import typer

app = typer.Typer(help="The rollout service.", no_args_is_help=True)


@app.command("worker")
def worker(
    port: int | None = typer.Option(None, help="HTTP port (default 8003, MEMPO_ROLLOUT_PORT)"),
    host: str | None = typer.Option(None, help="interface to bind (MEMPO_ROLLOUT_HOST)"),
    engine_url: str | None = typer.Option(None, help="the engine (MEMPO_ROLLOUT_ENGINE_URL)"),
    redis_url: str | None = typer.Option(None, help="'' for HTTP only (MEMPO_ROLLOUT_REDIS_URL)"),
    retrieval_url: str | None = typer.Option(None, help="MEMPO_ROLLOUT_RETRIEVAL_URL"),
    scorer_url: str | None = typer.Option(None, help="'' for no scoring (MEMPO_ROLLOUT_SCORER_URL)"),
) -> None:
    """Serve a rollout worker: its HTTP API, and the Redis consumer loop in the background.

    Every setting is also read from MEMPO_ROLLOUT_* environment variables."""
    from mempo.settings import quiet_hub, serve
    from services.rollout.app import create_app
    from services.rollout.settings import WorkerSettings

    quiet_hub()
    given: dict[str, Any] = {
        "port": port,
        "host": host,
        "engine_url": engine_url,
        "redis_url": redis_url,
        "retrieval_url": retrieval_url,
        "scorer_url": scorer_url,
    }
    settings = WorkerSettings(**{k: v for k, v in given.items() if v is not None})
    serve(create_app(settings), settings)


@app.command("engine")
def engine(
    port: int | None = typer.Option(None, help="HTTP port (default 30000, MEMPO_ENGINE_PORT)"),
    host: str | None = typer.Option(None, help="interface to bind (MEMPO_ENGINE_HOST)"),
    model_path: str | None = typer.Option(None, help="HF model folder (default: the tiny model)"),
    weights_root: str | None = typer.Option(None, help="weight updates only from inside this"),
    weight_version: str | None = typer.Option(None, help="initial weight_version (default 0)"),
    max_batch_size: int | None = typer.Option(None, help="rows decoded together (default 32)"),
    context_length: int | None = typer.Option(None, help="prompt + new tokens limit"),
) -> None:
    """Serve the CPU engine: SGLang's native HTTP API, backed by transformers.

    Every setting is also read from MEMPO_ENGINE_* environment variables."""
    from mempo.settings import quiet_hub, serve
    from services.rollout.engine.app import create_app
    from services.rollout.engine.settings import EngineSettings

    quiet_hub()
    given: dict[str, Any] = {
        "port": port,
        "host": host,
        "model_path": model_path,
        "weights_root": weights_root,
        "weight_version": weight_version,
        "max_batch_size": max_batch_size,
        "context_length": context_length,
    }
    settings = EngineSettings(**{k: v for k, v in given.items() if v is not None})
    serve(create_app(settings), settings)
