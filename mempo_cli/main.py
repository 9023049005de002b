"""The ``mempo`` command line.

Core commands live here; each service adds its own group from ``services/<name>/cli.py``
(``mempo retrieval ...``, ``mempo scorer ...``, ``mempo rollout ...``, ``mempo learner
...``), and the system commands (``mempo up``, ``mempo eval``, ``mempo sft``) come from
the modules that implement them. Heavy imports (torch, transformers) happen inside the
commands, so ``mempo --help`` is quick. Bad arguments exit with code 2 and a message.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mempo.options import SETTINGS_ARGS
from mempo.settings import configure_logging, fail, quiet_hub
from mempo_cli import docs_config
from services.learner import cli as learner_cli
from services.retrieval import cli as retrieval_cli
from services.rollout import cli as rollout_cli
from services.scorer import cli as scorer_cli

if TYPE_CHECKING:
    from mempo_cli.launcher.evaluate import EvalOptions
    from mempo_cli.launcher.heldout import HeldOut
    from mempo_cli.launcher.up import UpOptions

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
runs_app = typer.Typer(help="Run folders (runs/<name>/).", no_args_is_help=True)
app.add_typer(world_app, name="world")
app.add_typer(runs_app, name="runs")

log = logging.getLogger(__name__)


@tiny_app.command("build")
def tiny_build(
    out: Annotated[Path | None, typer.Option(help="output folder (HF format)")] = None,
    preset: Annotated[str, typer.Option(help="test (random weights, seconds) | reader (reading drills, about 4 minutes)")] = "test",
    seed: Annotated[int, typer.Option(help="weight initialisation seed")] = 0,
    ship: Annotated[bool, typer.Option(help="write it to mempo_sim/assets/, where every run finds it (then commit it)")] = False,
) -> None:
    """Build the tiny model and tokenizer locally (no download)."""
    import shutil
    from dataclasses import replace

    from mempo_sim.tiny import ASSETS, PRESETS, build_tiny, shipped

    if preset not in PRESETS:
        fail(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    if (out is None) == (not ship):
        fail("give --out DIR or --ship (not both)")
    configure_logging()
    quiet_hub()
    config = replace(PRESETS[preset], seed=seed)
    if ship:
        out = shipped(config)
        stale = [p for p in ASSETS.glob("tiny-*") if p.name != out.name]
        for path in stale:  # one shipped build: older recipes are never found again
            shutil.rmtree(path)
    assert out is not None
    path = build_tiny(out, config)
    typer.echo(str(path))


@world_app.command("corpus")
def world_corpus(
    out: Annotated[Path, typer.Option(help="jsonl file to write (wiki-18 format)")],
    seed: Annotated[int, typer.Option()] = 0,
    people: Annotated[int, typer.Option(min=1, help="people (with the default 46 other entities, 254 at most)")] = 80,
) -> None:
    """Write the world's passages as wiki-18 style jsonl."""
    from mempo_sim.world import World, WorldConfig

    try:
        world = World.generate(WorldConfig(seed=seed, people=people))
    except ValueError as exc:  # more entities than the name pool holds
        fail(str(exc))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        for passage in world.passages:
            handle.write(json.dumps(passage) + "\n")
    typer.echo(f"wrote {len(world.passages)} passages to {out}")


@app.command("up", context_settings=SETTINGS_ARGS)
def up(ctx: typer.Context) -> None:
    """Run the whole training loop on this machine (CPU, no set-up), then plot it.

    The defaults are the tiny model's recipe; --help lists every option with its default."""
    from dataclasses import replace

    from mempo_cli.launcher.heldout import HELDOUT
    from mempo_cli.launcher.up import run_up
    from mempo_cli.launcher.up_options import parse_up
    from mempo_cli.launcher.warmstart import WarmStart, warm_started_policy

    opts = parse_up(ctx.args)
    quiet_hub()
    configure_logging("WARNING")
    model = opts.model
    policy = model.resolve() if model else warm_started_policy(WarmStart(world_seed=opts.world_seed))
    check = replace(HELDOUT, world_seed=opts.world_seed)
    try:
        start = _heldout(policy, opts.run_dir / "heldout-start", check, cached=model is None) if opts.heldout else None
        heading = f"held-out EM before RL: {start.em:.3f} ({start.questions} questions, greedy)" if start else ""
        final = run_up(opts, policy, heading)
        end = _heldout(opts.run_dir.resolve() / "weights" / f"v{final.get('version')}",
                       opts.run_dir / "heldout-end", check, cached=False) if opts.heldout else None
    except (RuntimeError, TimeoutError) as exc:  # a child (ChildFailed) or redis-server failed
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        typer.echo(f"interrupted; services stopped. Logs: {opts.run_dir / 'logs'}", err=True)
        raise typer.Exit(130) from None
    report = _up_report(opts, final, start, end)
    typer.echo(json.dumps(report, indent=1))


def _heldout(policy: Path, out: Path, opts: EvalOptions, cached: bool) -> HeldOut:
    """The held-out score of ``policy`` (cached in its folder when ``cached``), shown."""
    from mempo_cli.launcher.heldout import cached_heldout_score, heldout_score

    if not (policy / "config.json").exists():
        raise RuntimeError(f"no policy to score at {policy}")
    typer.echo(f"[mempo] held-out check of {policy} (every held-out question, greedy)", err=True)
    score = (cached_heldout_score if cached else heldout_score)(policy, out, opts)
    typer.echo(f"[mempo] held-out EM {score.em:.3f} on {score.questions} questions (format {score.format_rate:.2f})",
               err=True)  # fmt: skip
    return score


def _up_report(opts: UpOptions, final: dict[str, Any], start: HeldOut | None, end: HeldOut | None) -> dict[str, Any]:
    """Write the run's heldout.json and plots; the final JSON of ``mempo up``."""
    from dataclasses import asdict

    from mempo_cli.launcher.plots import plot_run

    if start is not None and end is not None:
        heldout = {"start": asdict(start), "end": asdict(end), "end_step": final.get("step")}
        (opts.run_dir / "heldout.json").write_text(json.dumps(heldout, indent=1))
    metrics = final.get("last_metrics") or {}
    return {
        "run": str(opts.run_dir), "steps": final.get("step"), "version": final.get("version"),
        "wall_s": final.get("wall_s"), "reward": metrics.get("reward_mean"), "em": metrics.get("correct_rate"),
        "heldout_em_start": start.em if start else None, "heldout_em_end": end.em if end else None,
        "metrics": str(opts.run_dir / "metrics.jsonl"),
        "plots": [str(p) for p in plot_run(opts.run_dir / "metrics.jsonl", opts.run_dir)],
    }  # fmt: skip


@app.command("plot")
def plot_cmd(
    run: Annotated[Path, typer.Argument(help="run folder holding metrics.jsonl (runs/<name>, or a learner's RUN_DIR)")],
) -> None:
    """Draw a run's PNG plots from its metrics.jsonl (what ``mempo up`` does at the end)."""
    from mempo_cli.launcher.plots import plot_run

    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        fail(f"{metrics} not found: give a run folder that holds metrics.jsonl")
    written = plot_run(metrics, run)
    if not written:
        fail(f"{metrics} holds no step with figures to plot")
    for path in written:
        typer.echo(str(path))


@runs_app.command("compare")
def runs_compare(
    runs: Annotated[list[Path], typer.Argument(metavar="RUN", help="run folders holding metrics.jsonl (runs/a runs/b ...)")],
    out: Annotated[Path, typer.Option(help="the PNG (its table beside it as .json)")] = Path("compare.png"),
    labels: Annotated[str | None, typer.Option(help="a name per run, comma separated (default: folder names)")] = None,
) -> None:
    """Runs side by side: their curves on one PNG, a table of their final figures."""
    from mempo_cli.launcher.compare import compare_runs, print_table

    names = [name.strip() for name in labels.split(",")] if labels is not None else None
    if names is not None and len(names) != len(runs):
        fail(f"--labels has {len(names)} names for {len(runs)} runs")
    try:
        figures = compare_runs(runs, out, names)
    except ValueError as exc:
        fail(str(exc))
    print_table(figures)
    typer.echo(f"wrote {out} and {out.with_suffix('.json')}")


@app.command("eval")
def evaluate_cmd(
    model: Annotated[Path, typer.Option(help="policy to evaluate (HF folder, e.g. runs/<name>/weights/v20)")],
    ks: Annotated[str, typer.Option(help="questions per task, comma separated")] = "1,2,4,6,8,10",
    tasks: Annotated[int, typer.Option(min=1, help="held-out tasks per number of questions")] = 20,
    every_question: Annotated[
        bool, typer.Option(help="--ks 1 only: every distinct held-out question once, instead of --tasks drawn")
    ] = False,
    modes: Annotated[str, typer.Option(help="memory,full | memory | full")] = "memory,full",
    score: Annotated[bool, typer.Option(help="also report P_mem / P_full (starts the scorer)")] = False,
    out: Annotated[Path | None, typer.Option(help="folder for eval.json, eval.png and logs")] = None,
    engine_url: Annotated[
        str | None,
        typer.Option(help="a running engine serving --model (SGLang on a GPU); default: start a CPU engine"),
    ] = None,
    world_seed: Annotated[int, typer.Option(help="the agent's world (its test split is held out)")] = 0,
    transcripts: Annotated[
        int, typer.Option(min=0, help="write this many decoded episodes per mode and k (transcripts-<mode>-k<k>.md, .jsonl)")
    ] = 0,
    track: Annotated[str, typer.Option(help="trackers of the figures beside eval.json: tensorboard, wandb, mlflow")] = "",
) -> None:
    """Evaluate a policy on held-out world tasks: EM, F1, total and peak tokens per task,
    and how the episodes failed (failure kinds: mempo_cli/launcher/transcripts.py)."""
    from mempo_cli.launcher.evaluate import EvalOptions, evaluate, plot_eval

    if not (model / "config.json").exists():
        fail(f"--model {model} is not an HF model folder (no config.json)")
    try:
        k_list = [int(k) for k in ks.split(",") if k.strip()]
    except ValueError:
        fail(f"--ks must be integers separated by commas (got {ks!r})")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    if not k_list or min(k_list) < 1 or not mode_list or set(mode_list) - {"memory", "full"}:
        fail("--ks needs positive integers and --modes memory and/or full")
    if every_question and k_list != [1]:
        fail(f"--every-question evaluates 1-question tasks: give --ks 1 (got {ks!r})")
    if engine_url is not None and not engine_url.startswith(("http://", "https://")):
        fail(f"--engine-url must be an http:// or https:// URL (got {engine_url!r})")
    from mempo.tracking import backend_names, check_backends

    try:
        trackers = check_backends(backend_names(track))
    except ValueError as exc:
        fail(f"--track: {exc}")
    quiet_hub()
    configure_logging("WARNING")
    out = out or model.resolve().parent / f"eval-{model.name}"
    engine = engine_url.rstrip("/") if engine_url else None
    opts = EvalOptions(ks=k_list, tasks=tasks, modes=mode_list, score=score, engine_url=engine,
                       every_question=every_question, world_seed=world_seed, transcripts=transcripts,
                       track=trackers)
    try:
        report = evaluate(model.resolve(), out, opts)
    except (RuntimeError, TimeoutError) as exc:  # a child (ChildFailed) or redis-server failed
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    (out / "eval.json").write_text(json.dumps(report, indent=1))
    png = plot_eval(report, out / "eval.png")
    _show_eval(report, f"eval of {model}")
    written = sorted(out.glob("transcripts-*.md")) if transcripts else []
    typer.echo(f"wrote {out / 'eval.json'} and {png}" + "".join(f", {p}" for p in written))


def _show_eval(report: dict[str, Any], title: str) -> None:
    """The figures of ``mempo eval`` as a table, then each mode and k's failure kinds."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("mode", "k", "EM", "F1", "format", "tokens/task", "peak tokens", "with full history: tokens, peak"):
        table.add_column(column, justify="right")
    for mode, by_k in report["results"].items():
        for k, f in by_k.items():
            history = f"{f['full_history_tokens_per_task']:.0f}, {f['full_history_peak_tokens']:.0f}" if mode == "memory" else ""
            table.add_row(mode, k, f"{f['em']:.3f}", f"{f['f1']:.3f}", f"{f['format_rate']:.2f}",
                          f"{f['tokens_per_task']:.0f}", f"{f['peak_tokens']:.0f}", history)  # fmt: skip
    Console().print(table)
    for mode, by_k in report["failures"].items():
        for k, counts in by_k.items():
            typer.echo(f"{mode} k={k}: " + ", ".join(f"{kind} {n}" for kind, n in counts.items() if n))


# Groups and commands defined next to the code they run (their heavy imports stay
# inside the commands, so mounting them is quick).
app.add_typer(retrieval_cli.app, name="retrieval")
app.add_typer(scorer_cli.app, name="scorer")
app.add_typer(rollout_cli.app, name="rollout")
app.add_typer(learner_cli.app, name="learner")
app.add_typer(docs_config.app, name="docs")
learner_cli.register_top_level(app)  # mempo sft


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
