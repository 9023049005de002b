"""`mempo learner ...` commands (heavy imports stay inside the commands)."""

from __future__ import annotations

import typer

app = typer.Typer(help="The learner service.", no_args_is_help=True)
