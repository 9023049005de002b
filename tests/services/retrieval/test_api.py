"""POST /retrieve as Search-R1's retriever, /v1/info, /metrics, and bad input -> 4xx."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mempo.agent_format import format_documents, information_block
from mempo.clients.retrieval import RetrievalClient, RetrievalError
from mempo_sim.world import World
from services.retrieval.app import create_app
from services.retrieval.settings import RetrievalSettings
from tests.services.retrieval.conftest import Serve


def passages2string(retrieval_result: list[dict[str, Any]]) -> str:
    """Search-R1's ``_passages2string``, written from its description (reference/retrieval.md):
    the title is the first line of ``contents`` (quotes kept), the text the rest."""
    format_reference = ""
    for idx, doc_item in enumerate(retrieval_result):
        content = doc_item["document"]["contents"]
        title = content.split("\n")[0]
        text = "\n".join(content.split("\n")[1:])
        format_reference += f"Doc {idx + 1}(Title: {title}) {text}\n"
    return format_reference


def one_hop(world: World, n: int = 5) -> list[Any]:
    return [q for q in world.questions if len(q.relations) == 1][:n]


async def test_scored_results_have_search_r1_shape(client: httpx.AsyncClient, world: World) -> None:
    questions = one_hop(world, 3)
    body = {"queries": [q.text for q in questions], "topk": 2, "return_scores": True}
    response = await client.post("/retrieve", json=body)
    assert response.status_code == 200
    payload = response.json()
    assert list(payload) == ["result"] and len(payload["result"]) == 3
    for question, hits in zip(questions, payload["result"], strict=True):
        assert len(hits) == 2
        for hit in hits:
            assert set(hit) == {"document", "score"} and set(hit["document"]) == {"id", "contents"}
            assert isinstance(hit["score"], float) and isinstance(hit["document"]["id"], str)
            assert re.fullmatch(r"[^\n]+\n.+", hit["document"]["contents"], re.S)  # "Title\nbody"
        assert hits[0]["score"] >= hits[1]["score"]
        assert hits[0]["document"] == world.passages[int(hits[0]["document"]["id"])]
        assert hits[0]["document"]["contents"].startswith(f"{question.subject}\n")


@pytest.mark.parametrize("body_extra", [{"return_scores": False}, {}])
async def test_without_scores_documents_are_bare(
    client: httpx.AsyncClient, world: World, body_extra: dict[str, Any]
) -> None:
    question = one_hop(world, 1)[0]
    response = await client.post("/retrieve", json={"queries": [question.text], **body_extra})
    assert response.status_code == 200
    hits = response.json()["result"][0]
    assert len(hits) == 3  # topk absent: the server default, as in Search-R1
    assert all(set(hit) == {"id", "contents"} for hit in hits)
    scored = await client.post(
        "/retrieve", json={"queries": [question.text], "topk": None, "return_scores": True}
    )
    assert [h["document"] for h in scored.json()["result"][0]] == hits


async def test_queries_with_nothing_to_find_get_empty_lists(client: httpx.AsyncClient) -> None:
    body = {"queries": ["", "the of and", "born"], "topk": 3, "return_scores": True}
    result = (await client.post("/retrieve", json=body)).json()["result"]
    assert result[0] == [] and result[1] == [] and len(result[2]) == 3


async def test_search_r1_formatting_matches_the_agent_formatter(
    client: httpx.AsyncClient, world: World
) -> None:
    questions = one_hop(world, 4)
    body = {"queries": [q.text for q in questions], "topk": 3, "return_scores": True}
    result = (await client.post("/retrieve", json=body)).json()["result"]
    for question, hits in zip(questions, result, strict=True):
        expected = passages2string(hits)
        assert format_documents(hits) == expected.strip()
        assert information_block(format_documents(hits)) == (
            f"\n\n<information>{expected.strip()}</information>\n\n"
        )
        first = hits[0]["document"]["contents"].split("\n", 1)[1]
        assert expected.startswith(f"Doc 1(Title: {question.subject}) {first}\nDoc 2(Title: ")
    multi_line = [{"document": {"id": "9", "contents": '"T"\nline one\nline two'}, "score": 1.0}]
    assert format_documents(multi_line) == passages2string(multi_line).strip()
    assert format_documents(multi_line) == 'Doc 1(Title: "T") line one\nline two'


async def test_the_client_searches_and_formats(client: httpx.AsyncClient, world: World) -> None:
    question = one_hop(world, 1)[0]
    retrieval = RetrievalClient("http://retrieval", client=client)
    text = await retrieval.search(question.text)
    assert text.startswith(f"Doc 1(Title: {question.subject}) ") and text.count("\nDoc ") == 2
    assert question.answers[0] in text.split("\n")[0]
    info = await retrieval.info()
    assert info.backend == "bm25" and info.corpus_size == len(world.passages)
    with pytest.raises(RetrievalError, match="HTTP 422"):
        await retrieval.retrieve(["x"], topk=1000)


async def test_info_describes_the_embedded_index(client: httpx.AsyncClient, world: World) -> None:
    info = (await client.get("/v1/info")).json()
    assert info["backend"] == "bm25" and info["corpus_size"] == len(world.passages)
    assert info["index_path"] is None and info["index_build_s"] >= 0
    assert info["default_topk"] == 3 and info["corpus"] == "built-in world (seed 0)"
    assert (await client.get("/ready")).json() == {"ready": True, "reason": None}


async def test_metrics_count_requests_queries_and_latency(client: httpx.AsyncClient) -> None:
    for n in (1, 4):
        await client.post("/retrieve", json={"queries": ["born"] * n})
    await client.post("/retrieve", json={"queries": []})
    text = (await client.get("/metrics")).text
    assert "mempo_retrieval_queries_total 5.0" in text
    assert 'mempo_retrieval_requests_total{code="200",route="/retrieve"} 2.0' in text
    assert 'mempo_retrieval_requests_total{code="422",route="/retrieve"} 1.0' in text
    assert 'mempo_retrieval_request_latency_seconds_bucket{le="0.1",route="/retrieve"}' in text
    assert "mempo_retrieval_search_latency_seconds_count 2.0" in text
    assert "mempo_retrieval_batch_size_queries_sum 5.0" in text


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"queries": []}, 422, "queries: List should have at least 1 item"),
        ({}, 422, "queries: Field required"),
        ({"queries": "what"}, 422, "queries: Input should be a valid list"),
        ({"queries": [3]}, 422, "queries.0: Input should be a valid string"),
        ({"queries": ["a", None]}, 422, "queries.1: Input should be a valid string"),
        ({"queries": ["a"], "topk": 0}, 422, "topk: Input should be greater than or equal to 1"),
        ({"queries": ["a"], "topk": "many"}, 422, "topk: Input should be a valid integer"),
        ({"queries": ["a"], "topk": True}, 422, "topk: Value error, topk must be an integer"),
        ({"queries": ["a"], "topk": 101}, 422, "topk: 101 exceeds max_topk=100"),
        (
            {"queries": ["a"], "return_scores": "maybe"},
            422,
            "return_scores: Input should be a valid boolean",
        ),
        (
            {"queries": ["a", "b" * 2049]},
            422,
            "queries.1: 2049 characters exceed max_query_chars=2048",
        ),
        ({"queries": ["a"] * 4097}, 413, "queries: 4097 queries exceed max_queries=4096"),
        (
            {"queries": ["twenty characters ab"] * 4096, "topk": 100},  # 0.1 MB asking for 240 MB
            413,
            "queries x topk: 4096 x 100 = 409600 results exceed max_results=16384",
        ),
        ({"queries": ["a"] * 4097, "topk": 100}, 413, "queries: 4097 queries exceed max_queries"),
        ([{"queries": ["a"]}], 422, "body: Input should be a valid dictionary"),
    ],
)
async def test_bad_input_gets_4xx_naming_the_field(
    client: httpx.AsyncClient, body: Any, status: int, message: str
) -> None:
    response = await client.post("/retrieve", json=body)
    assert response.status_code == status
    assert response.json()["message"].startswith(message)


async def test_malformed_and_oversized_bodies(serve: Serve) -> None:
    async with serve(max_body_bytes=4096, max_queries=8) as client:
        not_json = await client.post(
            "/retrieve", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert not_json.status_code == 422 and "JSON decode error" in not_json.json()["message"]
        form = await client.post("/retrieve", content=b"queries=a")
        assert form.status_code == 422
        huge = await client.post("/retrieve", json={"queries": ["x" * 5000]})
        assert huge.status_code == 413 and "4096 bytes" in huge.json()["message"]
        many = await client.post("/retrieve", json={"queries": ["x"] * 9})
        assert many.status_code == 413 and "max_queries=8" in many.json()["message"]

    async with serve(max_results=6) as client:  # queries x topk, topk null: default_topk (3)
        assert (await client.post("/retrieve", json={"queries": ["x", "y"]})).status_code == 200
        three = await client.post("/retrieve", json={"queries": ["x", "y", "z"]})
        assert three.status_code == 413 and "3 x 3 = 9 results exceed max_results=6" in three.json()["message"]
        assert (await client.post("/retrieve", json={"queries": ["x"] * 6, "topk": 1})).status_code == 200
        assert (await client.get("/retrieve")).status_code == 405
        assert (await client.get("/nowhere")).status_code == 404


# --------------------------------------------------------------------------- fuzz

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
BODIES = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "queries": st.one_of(JSON, st.lists(st.text(max_size=40), max_size=6)),
            "topk": st.one_of(JSON, st.integers(-5, 200)),
            "return_scores": JSON,
            "extra": JSON,
        },
    ),
    JSON,
)


@pytest.fixture(scope="module")
def sync_client() -> Iterator[TestClient]:
    with TestClient(create_app(RetrievalSettings())) as test_client:
        yield test_client


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODIES)
def test_fuzzed_json_bodies_never_get_a_5xx(sync_client: TestClient, body: Any) -> None:
    response = sync_client.post("/retrieve", json=body)
    assert response.status_code in (200, 413, 422), response.text
    if response.status_code != 200:
        assert response.json()["message"]


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=200))
def test_fuzzed_raw_bytes_never_get_a_5xx(sync_client: TestClient, raw: bytes) -> None:
    response = sync_client.post(
        "/retrieve", content=raw, headers={"content-type": "application/json"}
    )
    # 400: FastAPI cannot decode the bytes at all (invalid UTF-8); 422: not a valid request.
    assert response.status_code in (200, 400, 422), response.text
    assert response.status_code == 200 or json.loads(response.text)["message"]
