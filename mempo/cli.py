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


@app.command("up")
def up(
    steps: Annotated[int, typer.Option(min=1, help="training steps to run")] = 20,
    rollout_replicas: Annotated[int, typer.Option(min=1, max=16, help="CPU engine + worker pairs")] = 1,
    name: Annotated[str | None, typer.Option(help="run name: runs/<name>/ (default: a timestamp)")] = None,
    model: Annotated[Path | None, typer.Option(help="policy (HF folder); default: the tiny model, SFT warm-started")] = None,
    questions: Annotated[str, typer.Option(help='questions per task: "2", "1,2,4" or "1-3"')] = "1-2",
    group_size: Annotated[int, typer.Option(min=2, help="rollouts per task (GRPO group)")] = 8,
    batch_groups: Annotated[int, typer.Option(min=1, help="groups per training step")] = 4,
    mode: Annotated[str, typer.Option(help="memory (MemPO) | full (full-history baseline)")] = "memory",
    max_rounds: Annotated[int, typer.Option(min=1)] = 6,
    max_staleness: Annotated[int, typer.Option(min=0, help="0: fully on-policy")] = 1,
    lr: Annotated[float | None, typer.Option(help="learning rate (default: the trainer's)")] = None,
    alpha: Annotated[float | None, typer.Option(help="memory advantage weight; 0 = plain GRPO")] = None,
    mem_min_std: Annotated[
        float | None, typer.Option(min=0, help="memory-advantage pools with a smaller std get none (default 0.05)")
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    runs_root: Annotated[Path, typer.Option(help="where run folders go")] = Path("runs"),
    display: Annotated[bool, typer.Option(help="live progress (a table on a terminal)")] = True,
) -> None:
    """Run the whole training loop on this machine (CPU, no set-up), then plot it."""
    import time

    from mempo.launcher.up import UpOptions, run_up
    from mempo.launcher.warmstart import WarmStart, warm_started_policy

    if mode not in ("memory", "full"):
        fail(f"--mode must be memory or full (got {mode!r})")
    if model is not None and not (model / "config.json").exists():
        fail(f"--model {model} is not an HF model folder (no config.json)")
    quiet_hub()
    configure_logging("WARNING")
    opts = UpOptions(
        name=name or time.strftime("up-%Y%m%d-%H%M%S"), steps=steps, rollout_replicas=rollout_replicas,
        model=model, runs_root=runs_root, questions_per_task=questions, group_size=group_size,
        batch_groups=batch_groups, mode=mode, max_rounds=max_rounds, max_staleness=max_staleness,
        lr=lr, alpha=alpha, mem_min_std=mem_min_std, seed=seed, display=display,
    )
    policy = model.resolve() if model else warm_started_policy(WarmStart())
    try:
        final = run_up(opts, policy)
    except (RuntimeError, TimeoutError) as exc:  # a child (ChildFailed) or redis-server failed
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo(f"interrupted; services stopped. Logs: {opts.run_dir / 'logs'}", err=True)
        raise typer.Exit(130) from None
    metrics = final.get("last_metrics") or {}
    typer.echo(json.dumps({
        "run": str(opts.run_dir), "steps": final.get("step"), "version": final.get("version"),
        "wall_s": final.get("wall_s"), "reward": metrics.get("reward_mean"), "em": metrics.get("correct_rate"),
        "metrics": str(opts.run_dir / "metrics.jsonl"), "plots": final.get("plots"),
    }, indent=1))  # fmt: skip


@app.command("plot")
def plot_cmd(
    run: Annotated[Path, typer.Argument(help="run folder holding metrics.jsonl (runs/<name>, or a learner's RUN_DIR)")],
) -> None:
    """Draw a run's PNG plots from its metrics.jsonl (what ``mempo up`` does at the end)."""
    from mempo.launcher.plots import plot_run

    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        fail(f"{metrics} not found: give a run folder that holds metrics.jsonl")
    written = plot_run(metrics, run)
    if not written:
        fail(f"{metrics} holds no step with figures to plot")
    for path in written:
        typer.echo(str(path))


@app.command("eval")
def evaluate_cmd(
    model: Annotated[Path, typer.Option(help="policy to evaluate (HF folder, e.g. runs/<name>/weights/v20)")],
    ks: Annotated[str, typer.Option(help="questions per task, comma separated")] = "1,2,4,6,8,10",
    tasks: Annotated[int, typer.Option(min=1, help="held-out tasks per number of questions")] = 20,
    modes: Annotated[str, typer.Option(help="memory,full | memory | full")] = "memory,full",
    score: Annotated[bool, typer.Option(help="also report P_mem / P_full (starts the scorer)")] = False,
    out: Annotated[Path | None, typer.Option(help="folder for eval.json, eval.png and logs")] = None,
    engine_url: Annotated[
        str | None,
        typer.Option(help="a running engine serving --model (SGLang on a GPU); default: start a CPU engine"),
    ] = None,
) -> None:
    """Evaluate a policy on held-out world tasks: EM, F1, total and peak tokens per task."""
    from rich.console import Console
    from rich.table import Table

    from mempo.launcher.evaluate import EvalOptions, evaluate, plot_eval

    if not (model / "config.json").exists():
        fail(f"--model {model} is not an HF model folder (no config.json)")
    try:
        k_list = [int(k) for k in ks.split(",") if k.strip()]
    except ValueError:
        fail(f"--ks must be integers separated by commas (got {ks!r})")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    if not k_list or min(k_list) < 1 or not mode_list or set(mode_list) - {"memory", "full"}:
        fail("--ks needs positive integers and --modes memory and/or full")
    if engine_url is not None and not engine_url.startswith(("http://", "https://")):
        fail(f"--engine-url must be an http:// or https:// URL (got {engine_url!r})")
    quiet_hub()
    configure_logging("WARNING")
    out = out or model.resolve().parent / f"eval-{model.name}"
    engine = engine_url.rstrip("/") if engine_url else None
    opts = EvalOptions(ks=k_list, tasks=tasks, modes=mode_list, score=score, engine_url=engine)
    try:
        report = evaluate(model.resolve(), out, opts)
    except (RuntimeError, TimeoutError) as exc:  # a child (ChildFailed) or redis-server failed
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    (out / "eval.json").write_text(json.dumps(report, indent=1))
    png = plot_eval(report, out / "eval.png")
    table = Table(title=f"eval of {model}")
    for column in ("mode", "k", "EM", "F1", "format", "tokens/task", "peak tokens"):
        table.add_column(column, justify="right")
    for mode, by_k in report["results"].items():
        for k, f in by_k.items():
            table.add_row(mode, k, f"{f['em']:.3f}", f"{f['f1']:.3f}", f"{f['format_rate']:.2f}",
                          f"{f['tokens_per_task']:.0f}", f"{f['peak_tokens']:.0f}")  # fmt: skip
    Console().print(table)
    typer.echo(f"wrote {out / 'eval.json'} and {png}")


# Groups and commands defined next to the code they run.
_EXTENSIONS = [
    ("services.retrieval.cli", "retrieval"),
    ("services.scorer.cli", "scorer"),
    ("services.rollout.cli", "rollout"),
    ("services.learner.cli", "learner"),
    ("mempo.docs_config", "docs"),
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
