"""The ``mempo`` command line.

Core commands live here; each service adds its own group from ``services/<name>/cli.py``
(``mempo retrieval ...``, ``mempo scorer ...``, ``mempo rollout ...``, ``mempo learner
...``), and the system commands (``mempo up``, ``mempo eval``, ``mempo sft``) come from
the modules that implement them. Heavy imports (torch, transformers) happen inside the
commands, so ``mempo --help`` is quick. Bad arguments exit with code 2 and a message.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer

from mempo.settings import configure_logging, quiet_hub

app = typer.Typer(
    name="mempo",
    help="MemPO: train LLM search agents that manage their own memory.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
tiny_app = typer.Typer(help="The tiny local Qwen2 model.", no_args_is_help=True)
world_app = typer.Typer(help="The built-in synthetic QA world.", no_args_is_help=True)
app.add_typer(tiny_app, name="tiny")
app.add_typer(world_app, name="world")

log = logging.getLogger(__name__)


def fail(message: str) -> None:
    """Exit 2 with a message on stderr (bad input: never a stack trace)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@tiny_app.command("build")
def tiny_build(
    out: Annotated[Path, typer.Option(help="output folder (HF format)")],
    preset: Annotated[str, typer.Option(help="test | small")] = "test",
    seed: Annotated[int, typer.Option(help="weight initialisation seed")] = 0,
) -> None:
    """Build the tiny model and tokenizer locally (no download)."""
    from dataclasses import replace

    from mempo.tiny import PRESETS, build_tiny

    if preset not in PRESETS:
        fail(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    configure_logging()
    quiet_hub()
    path = build_tiny(out, replace(PRESETS[preset], seed=seed))
    typer.echo(str(path))


@world_app.command("corpus")
def world_corpus(
    out: Annotated[Path, typer.Option(help="jsonl file to write (wiki-18 format)")],
    seed: Annotated[int, typer.Option()] = 0,
    people: Annotated[int, typer.Option(min=1)] = 200,
) -> None:
    """Write the world's passages as wiki-18 style jsonl."""
    from mempo.world import World, WorldConfig

    world = World.generate(WorldConfig(seed=seed, people=people))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for passage in world.passages:
            handle.write(json.dumps(passage) + "\n")
    typer.echo(f"wrote {len(world.passages)} passages to {out}")


# Groups and commands defined next to the code they run.
_EXTENSIONS = [
    ("services.retrieval.cli", "retrieval"),
    ("services.scorer.cli", "scorer"),
    ("services.rollout.cli", "rollout"),
    ("services.learner.cli", "learner"),
]


def _mount_extensions() -> None:
    for module_name, group in _EXTENSIONS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # that service has no CLI yet
            raise
        sub = getattr(module, "app", None)
        if sub is not None:
            app.add_typer(sub, name=group)
        register = getattr(module, "register_top_level", None)
        if register is not None:
            register(app)


def main() -> None:
    _mount_extensions()
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
