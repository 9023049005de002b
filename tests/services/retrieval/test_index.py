"""Index folders: build, manifest, load, and the `mempo retrieval build` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mempo.bm25 import Bm25Index
from mempo_sim.world import World
from services.retrieval.cli import app as cli
from services.retrieval.index import BadIndex, Manifest, build_index, load_index, open_index
from services.retrieval.settings import RetrievalSettings
from tests.services.retrieval.conftest import Serve, write_corpus


def test_build_writes_a_manifest_and_loads_back(
    world: World, world_corpus: Path, tmp_path: Path
) -> None:
    manifest = build_index(world_corpus, tmp_path / "idx")
    on_disk = Manifest.read(tmp_path / "idx")
    assert on_disk == manifest
    assert (manifest.backend, manifest.count, manifest.bad_lines) == (
        "bm25",
        len(world.passages),
        0,
    )
    assert manifest.model is None and manifest.build_s > 0
    loaded = load_index(tmp_path / "idx", RetrievalSettings())
    assert loaded.backend.name == "bm25" and len(loaded.store) == len(world.passages)
    # Same answers as an index built in memory from the same passages.
    memory = Bm25Index.build([p["contents"] for p in world.passages])
    questions = [q.text for q in world.questions[:50]]
    assert loaded.backend.search(questions, 3) == memory.search(questions, 3)
    assert loaded.store.document(5).model_dump() == world.passages[5]


def test_embedded_index_hashes_like_the_world_corpus_file(
    world_corpus: Path, tmp_path: Path
) -> None:
    built = build_index(world_corpus, tmp_path / "idx")
    embedded = open_index(RetrievalSettings())
    assert embedded.path is None and embedded.manifest.corpus_sha256 == built.corpus_sha256


def test_build_refuses_to_overwrite_without_force(world_corpus: Path, tmp_path: Path) -> None:
    build_index(world_corpus, tmp_path / "idx")
    with pytest.raises(BadIndex, match="--force"):
        build_index(world_corpus, tmp_path / "idx")
    assert build_index(world_corpus, tmp_path / "idx", force=True).count > 0
    assert [p.name for p in tmp_path.iterdir()] == ["idx"]  # no temporary folder left


def test_corpus_without_a_passage_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text("nope\n{}\n", encoding="utf-8")
    with pytest.raises(BadIndex, match="no valid passage"):
        build_index(tmp_path / "bad.jsonl", tmp_path / "idx")
    assert not (tmp_path / "idx").exists()


def test_loading_a_part_the_index_lacks_says_so(world_corpus: Path, tmp_path: Path) -> None:
    build_index(world_corpus, tmp_path / "idx")
    with pytest.raises(BadIndex, match="needs the dense part"):
        load_index(tmp_path / "idx", RetrievalSettings(backend="hybrid"))
    with pytest.raises(BadIndex, match=r"manifest\.json"):
        load_index(tmp_path, RetrievalSettings())


def test_cli_build_counts_a_broken_line_and_serves(world: World, tmp_path: Path) -> None:
    corpus = write_corpus(
        tmp_path / "c.jsonl", world.passages, broken={10: '{"id": "x", "contents'}
    )
    result = CliRunner().invoke(
        cli, ["build", "--corpus", str(corpus), "--out", str(tmp_path / "idx")]
    )
    assert result.exit_code == 0, result.output
    assert f"indexed {len(world.passages)} passages (1 bad lines)" in result.output
    assert "skipped line 11: not valid JSON" in result.output
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["count"] == len(world.passages) and manifest["bad_lines"] == 1
    assert manifest["backend"] == "bm25" and len(manifest["corpus_sha256"]) == 64


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "sparse"], "choose from bm25, dense, hybrid"),
        (["--dense-index", "ivf"], "choose from auto, flat, hnsw"),
        (["--corpus", "/nonexistent.jsonl"], "is not a file"),
    ],
)
def test_cli_build_rejects_bad_arguments(
    world_corpus: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    base = ["build", "--corpus", str(world_corpus), "--out", str(tmp_path / "idx")]
    result = CliRunner().invoke(cli, base + args)
    assert result.exit_code == 2 and message in result.output


def test_cli_serve_rejects_a_missing_index(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["serve", "--index", str(tmp_path / "none")])
    assert result.exit_code == 2 and "is not a folder" in result.output


async def test_service_serves_a_built_index(
    world: World, world_corpus: Path, tmp_path: Path, serve: Serve
) -> None:
    build_index(world_corpus, tmp_path / "idx")
    async with serve(index_path=tmp_path / "idx") as client:
        info = (await client.get("/v1/info")).json()
        assert info["index_path"] == str(tmp_path / "idx") and info["corpus_size"] == len(
            world.passages
        )
        question = next(q for q in world.questions if len(q.relations) == 1)
        body = {"queries": [question.text], "topk": 1, "return_scores": True}
        top = (await client.post("/retrieve", json=body)).json()["result"][0][0]
        assert top["document"]["contents"].startswith(f"{question.subject}\n")


async def test_an_unloadable_index_is_reported_by_ready(tmp_path: Path, serve: Serve) -> None:
    async with serve(index_path=tmp_path) as client:
        ready = await client.get("/ready")
        assert ready.status_code == 503 and "manifest.json" in ready.json()["reason"]
        response = await client.post("/retrieve", json={"queries": ["x"]})
        assert response.status_code == 503 and "failed to load" in response.json()["message"]
        assert (await client.get("/health")).status_code == 200
