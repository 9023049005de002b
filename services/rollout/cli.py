"""`mempo rollout ...` commands (heavy imports stay inside the commands)."""

from __future__ import annotations

import typer

app = typer.Typer(help="The rollout service.", no_args_is_help=True)
