"""`mempo scorer ...` commands (heavy imports stay inside the commands)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

app = typer.Typer(help="The scorer service: P_mem / P_full memory scores.", no_args_is_help=True)


@app.command("serve")
def serve_command(
    host: Annotated[str | None, typer.Option(help="interface to bind")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port (default 8002)")] = None,
    model_path: Annotated[str | None, typer.Option(help="HF causal LM folder")] = None,
    weights_root: Annotated[str | None, typer.Option(help="updates must lie inside it")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda[:N]")] = None,
    method: Annotated[str | None, typer.Option(help="shared | naive")] = None,
    redis_url: Annotated[str | None, typer.Option(help="register with this Redis")] = None,
) -> None:
    """Run the scorer (every setting also reads MEMPO_SCORER_<NAME> from the environment)."""
    from pydantic import ValidationError

    from mempo.settings import quiet_hub, serve
    from services.scorer.settings import ScorerSettings

    overrides: dict[str, Any] = {
        "host": host,
        "port": port,
        "model_path": model_path,
        "weights_root": weights_root,
        "device": device,
        "method": method,
        "redis_url": redis_url,
    }
    try:
        settings = ScorerSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        typer.echo(f"error: {'.'.join(map(str, err['loc']))}: {err['msg']}", err=True)
        raise typer.Exit(2) from None
    quiet_hub()
    from services.scorer.app import create_app

    serve(create_app(settings), settings)
