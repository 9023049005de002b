"""BM25 queries per second of the retrieval service, against rank-bm25 on the same corpus.

A 100k-passage synthetic wiki-18 style corpus (invented, unique names; world-style facts),
indexed once with `build_index`; batches of 64 questions, top-3. Measured in one run:

- bm25_qps: the service's BM25 (mempo.bm25 over the memory-mapped saved index), Python API;
- http_qps: the same through `POST /retrieve` of a `mempo retrieval serve` process, one
  batch at a time (http_concurrent_qps: 4 clients at once, which the service batches);
- baseline_qps: rank-bm25 (pure Python BM25Okapi, same tokens), a few queries;
- library_qps: bm25s's own search (``BM25.retrieve``: every document scored, then the top
  k) on the same index and the same tokens: ``library_ratio`` = bm25_qps / library_qps
  says whether our top-k (mempo/bm25.py) earns its place (issue 30: beat it or go).

Prints one JSON line. Usage: python benchmarks/retrieval_qps.py [--passages 100000]
(``--smoke``: seconds-scale sizes, checks it runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mempo.bm25 import Bm25Index, _tokenize  # noqa: E402
from mempo.procs import free_port, wait_ready  # noqa: E402
from services.retrieval.index import build_index, load_index  # noqa: E402
from services.retrieval.settings import RetrievalSettings  # noqa: E402

SYLLABLES = [
    *("ka", "ri", "zor", "van", "mel", "dro", "thi", "sel", "ul", "bar", "nek", "osk", "fen"),
    *("qua", "lor", "mi", "tas", "ven", "gra", "hol", "pir", "ed", "yun", "cal", "dex", "ro"),
    *("sa", "tum", "lek", "viv", "aur", "bo", "nim", "har", "sut", "kel", "ost", "wen", "ja"),
    "fir",
]
PROFESSIONS = ["painter", "engineer", "botanist", "sailor", "weaver", "chemist", "poet", "judge"]
BATCH, TOPK = 64, 3


def word(i: int) -> str:
    """The i-th invented word: base-40 digits as syllables (unique per i)."""
    parts = []
    while True:
        i, digit = divmod(i, len(SYLLABLES))
        parts.append(SYLLABLES[digit])
        if i == 0:
            break
    return "".join(parts).capitalize()


def synthetic_corpus(n: int, seed: int = 0) -> tuple[list[dict[str, str]], list[tuple[str, int]]]:
    """n passages about invented people, and one question per passage with its row."""
    rng = random.Random(seed)
    cities = [word(100_000 + i) for i in range(3000)]
    orgs = [
        f"{word(200_000 + i)} {rng.choice(['Guild', 'Bank', 'Institute'])}" for i in range(3000)
    ]
    first = [word(300_000 + i) for i in range(5000)]
    passages, questions = [], []
    for row in range(n):
        name = f"{rng.choice(first)} {word(400_000 + row)}"
        city, org = rng.choice(cities), rng.choice(orgs)
        body = (
            f"{name} was born in {rng.randint(1800, 1999)} in the city of {city}. "
            f"{name} is a {rng.choice(PROFESSIONS)} and works for {org}."
        )
        passages.append({"id": str(row), "contents": f'"{name}"\n{body}'})
        template = rng.choice(
            [
                "In which city was {} born?",
                "Which organization does {} work for?",
                "When was {} born?",
            ]
        )
        questions.append((template.format(name), row))
    return passages, questions


def python_qps(index: Bm25Index, batches: list[list[str]]) -> float:
    index.search(batches[0], TOPK)  # warm the memory-mapped pages
    started = time.perf_counter()
    for batch in batches:
        index.search(batch, TOPK)
    return sum(map(len, batches)) / (time.perf_counter() - started)


def library_qps(index: Bm25Index, batches: list[list[str]]) -> float:
    """bm25s's own retrieve on the same model, tokenising the same way as ``search``."""
    index.model.retrieve(_tokenize(batches[0]), k=TOPK, show_progress=False)
    started = time.perf_counter()
    for batch in batches:
        index.model.retrieve(_tokenize(batch), k=TOPK, show_progress=False)
    return sum(map(len, batches)) / (time.perf_counter() - started)


def http_qps(url: str, batches: list[list[str]], clients: int) -> float:
    async def run() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = {"topk": TOPK, "return_scores": True}
            await http.post("/retrieve", json={**body, "queries": batches[0]})
            queue = list(batches)

            async def client() -> None:
                while queue:
                    response = await http.post("/retrieve", json={**body, "queries": queue.pop()})
                    response.raise_for_status()

            started = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(clients)))
            return sum(map(len, batches)) / (time.perf_counter() - started)

    return asyncio.run(run())


def baseline_qps(passages: list[dict[str, str]], queries: list[str]) -> float:
    from rank_bm25 import BM25Okapi

    bm25 = BM25Okapi(_tokenize([p["contents"] for p in passages]))
    tokens = _tokenize(queries)
    started = time.perf_counter()
    for query in tokens:
        scores = bm25.get_scores(query)
        sorted(range(len(scores)), key=scores.__getitem__, reverse=True)[:TOPK]
    return len(queries) / (time.perf_counter() - started)


def serve(index_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MEMPO_RETRIEVAL_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "mempo_cli", "retrieval", "serve", "--index", str(index_dir)]
    proc = subprocess.Popen([*command, "--port", str(port)], cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, timeout_s=120, proc=proc)
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--baseline-queries", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: checks it runs, proves nothing")
    args = parser.parse_args()
    if args.smoke:  # 2 batches of 64 (so the 4 HTTP clients overlap), 1 rank-bm25 query
        args.passages, args.batches, args.baseline_queries = 500, 2, 1

    passages, questions = synthetic_corpus(args.passages)
    sample = random.Random(1).sample(questions, BATCH * args.batches)
    batches = [[q for q, _ in sample[i : i + BATCH]] for i in range(0, len(sample), BATCH)]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(p) + "\n" for p in passages), encoding="utf-8")
        manifest = build_index(corpus, Path(tmp) / "idx")
        index = load_index(Path(tmp) / "idx", RetrievalSettings()).backend
        assert isinstance(index, Bm25Index)
        bm25 = python_qps(index, batches)
        library = library_qps(index, batches)
        hits = index.search([q for q, _ in sample], TOPK)
        hit_at_3 = sum(row in [r for r, _ in h] for (_, row), h in zip(sample, hits, strict=True))
        proc, url = serve(Path(tmp) / "idx")
        try:
            http = http_qps(url, batches, clients=1)
            http_concurrent = http_qps(url, batches, clients=4)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    baseline = baseline_qps(passages, [q for q, _ in sample[: args.baseline_queries]])
    print(
        json.dumps(
            {
                "bm25_qps": round(bm25, 1),
                "http_qps": round(http, 1),
                "baseline_qps": round(baseline, 2),
                "ratio": round(bm25 / baseline, 1),
                "library_qps": round(library, 1),
                "library_ratio": round(bm25 / library, 2),
                "http_concurrent_qps": round(http_concurrent, 1),
                "passages": len(passages),
                "batch": BATCH,
                "topk": TOPK,
                "hit_at_3": round(hit_at_3 / len(sample), 4),
                "index_build_s": manifest.build_s,
            }
        )
    )


if __name__ == "__main__":
    main()
