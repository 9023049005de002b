"""atomic_dir: a folder is whole or absent, and nothing is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from mempo.files import atomic_dir


def test_a_filled_folder_replaces_the_old_one_whole(tmp_path: Path) -> None:
    final = tmp_path / "v1"
    final.mkdir()
    (final / "old.bin").write_text("old")
    with atomic_dir(final, durable=True) as tmp:
        (tmp / "new.bin").write_text("new")
        assert not (final / "new.bin").exists()  # nothing shows before the block ends
    assert [p.name for p in final.iterdir()] == ["new.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]


def test_an_error_leaves_the_old_folder_and_no_temporary_one(tmp_path: Path) -> None:
    final = tmp_path / "v1"
    final.mkdir()
    (final / "old.bin").write_text("old")
    with pytest.raises(OSError, match="disk full"), atomic_dir(final, prefix=".tmp-v1-") as tmp:
        (tmp / "half.bin").write_text("x")
        raise OSError("disk full")
    assert [p.name for p in final.iterdir()] == ["old.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]


def test_without_replace_an_existing_folder_is_kept(tmp_path: Path) -> None:
    final = tmp_path / "tiny"
    with atomic_dir(final, replace=False) as tmp:
        (tmp / "first").write_text("1")
        final.mkdir()  # another process finished the same build meanwhile
        (final / "theirs").write_text("2")
    assert [p.name for p in final.iterdir()] == ["theirs"]
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]
