"""`mempo scorer ...` commands (heavy imports stay inside the commands)."""

from __future__ import annotations

import typer

from mempo.options import SETTINGS_ARGS

app = typer.Typer(help="The scorer service: P_mem / P_full memory scores.", no_args_is_help=True)


@app.command("serve", context_settings=SETTINGS_ARGS)
def serve_command(ctx: typer.Context) -> None:
    """Run the scorer: every setting is an option (--model-path, --device, ...; --help
    lists them) and a MEMPO_SCORER_<NAME> variable; options win."""
    from mempo.options import settings_from_args
    from mempo.settings import quiet_hub, serve
    from services.scorer.settings import ScorerSettings

    settings = settings_from_args(ScorerSettings, ctx.args, "mempo scorer serve")
    quiet_hub()
    from services.scorer.app import create_app

    serve(create_app(settings), settings)
