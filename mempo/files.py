"""A folder that is whole or absent: filled aside, then renamed into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(
    final: Path, prefix: str | None = None, durable: bool = False, replace: bool = True
) -> Iterator[Path]:
    """A new temporary folder beside ``final`` to fill; when the block ends without an
    error it replaces ``final`` (one rename: a reader sees the old folder or the new one,
    never a part), and on an error it is removed and ``final`` left as it was.

    ``prefix``: the temporary folder's name prefix (default ``.tmp-<name>-``), so that
    leftovers of a crash can be recognised and cleaned. ``durable``: fsync the files and
    both folders, so the rename survives a power cut (checkpoints). ``replace`` False: an
    existing ``final`` (another process's build of the same thing) is kept, ours dropped."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix or f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        if durable:
            for path in tmp.iterdir():
                if path.is_file():
                    _fsync(path, os.O_RDONLY)
            _fsync(tmp, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        if final.exists() and replace:
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:  # not replace, and it exists (maybe made meanwhile): keep it
            if replace or not final.exists():
                raise
        if durable:
            _fsync(final.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
