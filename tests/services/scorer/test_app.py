"""The scorer's routes in-process: scores, bad input, limits, auth, weight updates."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from mempo.api.scorer import MemoryScoresResponse, ScoreResponse
from mempo_sim.world import World
from services.scorer.model import LoadedModel

from .conftest import AppClient, random_trajectory

TRAJECTORY = {
    "questions": ["Where was Bothi born?", "Who founded Lorlek Bank?"],
    "answers": [["Dostania", "Mirath"], ["Zortas Eddex"]],
    "rounds": [
        {"memory": "Q1: ?; Q2: ?", "transcript": "<mem>Q1: ?; Q2: ?</mem>\n<search>Bothi</search>"},
        {"memory": None, "transcript": "<search>Lorlek Bank</search>"},
        {"memory": "Q1: Dostania; Q2: Zortas Eddex", "transcript": "<answer>x</answer>"},
    ],
}


async def test_memory_scores_single_and_many(app_client: AppClient, world: World) -> None:
    async with app_client() as client:
        one = await client.post("/v1/memory-scores", json=TRAJECTORY)
        assert one.status_code == 200, one.text
        body = MemoryScoresResponse.model_validate_json(one.text)
        assert body.weight_version == "0"
        (result,) = body.results
        assert result.candidates == ["Dostania; Zortas Eddex", "Mirath; Zortas Eddex"]
        assert [r.index for r in result.rounds] == [0, 1, 2]
        assert result.rounds[1].p_mem is None and result.rounds[1].reward is None
        for r in result.rounds:
            assert 0 < r.p_full < 1
        r0 = result.rounds[0]
        assert r0.p_mem is not None and r0.reward == pytest.approx(r0.p_mem - r0.p_full)
        assert result.rounds[2].full_context_tokens > result.rounds[1].full_context_tokens
        rng = random.Random(5)
        many = [random_trajectory(rng, world, n).model_dump() for n in (1, 4, 8)]
        resp = await client.post("/v1/memory-scores", json={"trajectories": [TRAJECTORY, *many]})
        assert resp.status_code == 200, resp.text
        batch = MemoryScoresResponse.model_validate_json(resp.text)
        assert [len(r.rounds) for r in batch.results] == [3, 1, 4, 8]
        for alone, batched in zip(result.rounds, batch.results[0].rounds, strict=True):
            assert batched.p_full == pytest.approx(alone.p_full, rel=1e-4)  # padding aside


async def test_alias_policy_first_and_best(app_client: AppClient) -> None:
    async with app_client() as client:
        best = (await client.post("/v1/memory-scores", json=TRAJECTORY)).json()["results"][0]
        first_body = {**TRAJECTORY, "alias_policy": "first"}
        first = (await client.post("/v1/memory-scores", json=first_body)).json()["results"][0]
    assert first["candidates"] == ["Dostania; Zortas Eddex"]
    for b, f in zip(best["rounds"], first["rounds"], strict=True):
        assert b["p_full"] >= f["p_full"] * (1 - 1e-5)  # max over a superset of candidates
    async with app_client(alias_policy="first") as client:
        default = (await client.post("/v1/memory-scores", json=TRAJECTORY)).json()["results"][0]
    assert default == first


async def test_generic_score(app_client: AppClient) -> None:
    items = [
        {"context": "Bothi was born in", "answers": ["Dostania", "Mirath"]},
        {
            "context": [{"role": "user", "content": "Where was Bothi born?"}],
            "answers": ["Dostania"],
        },
    ]
    async with app_client() as client:
        resp = await client.post("/v1/score", json={"items": items})
    assert resp.status_code == 200, resp.text
    scores = ScoreResponse.model_validate_json(resp.text).scores
    assert scores[0].answer in ("Dostania", "Mirath")
    for s in scores:
        assert s.num_tokens > 0 and s.context_tokens > 0
        assert s.logprob_mean == pytest.approx(s.logprob_sum / s.num_tokens)
        assert s.p == pytest.approx(2.718281828459045**s.logprob_mean)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/memory-scores", {**TRAJECTORY, "answers": [[], ["x"]]}, "answers"),
        ("/v1/memory-scores", {**TRAJECTORY, "answers": [[" "], ["x"]]}, "answers"),
        ("/v1/memory-scores", {**TRAJECTORY, "rounds": []}, "rounds"),
        ("/v1/memory-scores", {**TRAJECTORY, "answers": [["x"]]}, "answers"),
        ("/v1/memory-scores", {"trajectories": []}, "trajectories"),
        ("/v1/memory-scores", {**TRAJECTORY, "alias_policy": "worst"}, "alias_policy"),
        ("/v1/score", {"items": [{"context": "a", "answers": []}]}, "answers"),
        ("/v1/score", {"items": [{"context": [], "answers": ["a"]}]}, "context"),
        ("/v1/score", {"items": [{"context": "", "answers": ["a"]}]}, "items.0.context"),
        ("/v1/score", {"items": []}, "items"),
    ],
)
async def test_bad_input_is_422_naming_the_field(
    app_client: AppClient, path: str, body: dict, field: str
) -> None:
    async with app_client() as client:
        resp = await client.post(path, json=body)
    assert resp.status_code == 422, resp.text
    assert field in resp.json()["message"]


async def test_oversize_is_413(app_client: AppClient) -> None:
    long_round = {"memory": "m", "transcript": "word " * 400}
    body = {**TRAJECTORY, "rounds": [long_round, long_round, long_round]}
    async with app_client(max_sequence_tokens=300) as client:
        resp = await client.post("/v1/memory-scores", json=body)
        assert resp.status_code == 413
        assert "trajectories.0" in resp.json()["message"]
    async with app_client(max_request_tokens=300) as client:
        resp = await client.post("/v1/memory-scores", json=body)
        assert resp.status_code == 413 and "max_request_tokens" in resp.json()["message"]
    async with app_client(max_body_bytes=2048) as client:
        resp = await client.post("/v1/memory-scores", json=body)
        assert resp.status_code == 413


async def test_admin_auth_and_weights_root(
    app_client: AppClient, weights_root: Path, tmp_path: Path
) -> None:
    async with app_client(admin_token="s3cret", weights_root=str(weights_root)) as client:
        body = {"model_path": str(weights_root / "v1"), "weight_version": "1"}
        assert (await client.post("/update_weights_from_disk", json=body)).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert (
            await client.post("/update_weights_from_disk", json=body, headers=wrong)
        ).status_code == 403
        auth = {"Authorization": "Bearer s3cret"}
        outside = {"model_path": str(tmp_path), "weight_version": "1"}
        resp = await client.post("/update_weights_from_disk", json=outside, headers=auth)
        assert resp.status_code == 403 and "weights root" in resp.json()["message"]
        escape = {"model_path": str(weights_root / ".." / tmp_path.name), "weight_version": "1"}
        assert (
            await client.post("/update_weights_from_disk", json=escape, headers=auth)
        ).status_code == 403
        missing = {"model_path": str(weights_root / "v9"), "weight_version": "9"}
        resp = await client.post("/update_weights_from_disk", json=missing, headers=auth)
        assert resp.status_code == 400 and resp.json()["success"] is False
        assert resp.json()["message"] == "model_path: <weights root>/v9 is not a folder"
        (weights_root / "v8").mkdir()
        (weights_root / "v8" / "model.safetensors").write_bytes(b"junk")
        broken = {"model_path": str(weights_root / "v8"), "weight_version": "8"}
        resp = await client.post("/update_weights_from_disk", json=broken, headers=auth)
        assert resp.status_code == 400 and str(weights_root.resolve()) not in resp.text
        assert (await client.get("/model_info")).json()["weight_version"] == "0"


async def test_weight_update_changes_scores_and_version(
    app_client: AppClient, weights_root: Path
) -> None:
    async with app_client(weights_root=str(weights_root)) as client:
        before = (await client.post("/v1/memory-scores", json=TRAJECTORY)).json()
        body = {"model_path": str(weights_root / "v1"), "weight_version": "1"}
        resp = await client.post("/update_weights_from_disk", json=body)
        assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
        info = (await client.get("/model_info")).json()
        assert info["weight_version"] == "1" and info["model_path"] == str(weights_root / "v1")
        after = (await client.post("/v1/memory-scores", json=TRAJECTORY)).json()
    assert before["weight_version"] == "0" and after["weight_version"] == "1"
    p_before = [r["p_full"] for r in before["results"][0]["rounds"]]
    p_after = [r["p_full"] for r in after["results"][0]["rounds"]]
    assert all(abs(a - b) > 1e-6 for a, b in zip(p_before, p_after, strict=True))


async def test_concurrent_requests_share_batches(app_client: AppClient) -> None:
    async with app_client(max_wait_ms=200.0) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/memory-scores", json=TRAJECTORY) for _ in range(6))
        )
        metrics = (await client.get("/metrics")).text
    assert all(r.status_code == 200 for r in responses)
    assert len({r.text for r in responses}) == 1
    count = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("mempo_scorer_batch_latency_seconds_count")
    )
    assert count < 6  # at least two requests rode in one batch


async def test_health_ready_and_naive_method(app_client: AppClient) -> None:
    async with app_client() as client:
        shared = (await client.post("/v1/memory-scores", json=TRAJECTORY)).json()
    async with app_client(method="naive") as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/ready")).json() == {"ready": True, "reason": None}
        naive = (await client.post("/v1/memory-scores", json=TRAJECTORY)).json()
    for s, n in zip(shared["results"][0]["rounds"], naive["results"][0]["rounds"], strict=True):
        assert s["p_full"] == pytest.approx(n["p_full"], rel=1e-4)


async def test_p_task_is_the_empty_memory_score_once_per_task(app_client: AppClient) -> None:
    """task_score: P_task = P(gold | task + an empty memory), exactly what P_mem is for a
    round whose memory is ""; one context per distinct task; null without task_score."""
    empty = {**TRAJECTORY, "rounds": [{"memory": "", "transcript": "<mem></mem>\n<search>Bothi</search>"}]}
    other = {**TRAJECTORY, "questions": ["Where was Edvan born?"], "answers": [["Vanzor"]]}
    async with app_client() as client:
        plain = (await client.post("/v1/memory-scores", json=TRAJECTORY)).json()["results"][0]
        body = {"trajectories": [TRAJECTORY, empty, other], "task_score": True}
        reply = await client.post("/v1/memory-scores", json=body)
    assert reply.status_code == 200, reply.text
    scored, same_task, other_task = reply.json()["results"]
    assert plain["p_task"] is None
    assert 0 < scored["p_task"] < 1 and same_task["p_task"] == scored["p_task"]
    assert scored["p_task"] == pytest.approx(same_task["rounds"][0]["p_mem"], rel=1e-4)
    assert other_task["p_task"] != scored["p_task"]
    for with_task, alone in zip(scored["rounds"], plain["rounds"], strict=True):
        assert with_task["p_full"] == pytest.approx(alone["p_full"], rel=1e-4)  # nothing else moves


def test_one_p_task_context_per_distinct_task(loaded: LoadedModel) -> None:
    from mempo.api.scorer import MemoryScoresRequest
    from mempo.metrics import Metrics
    from services.scorer.scorer import ScorerService
    from services.scorer.settings import ScorerSettings

    other = {**TRAJECTORY, "questions": ["Where was Edvan born?"], "answers": [["Vanzor"]]}
    body = {"trajectories": [TRAJECTORY, other, TRAJECTORY, other, TRAJECTORY], "task_score": True}
    scorer = ScorerService(ScorerSettings(), loaded, Metrics("scorer"))
    plan = scorer.plan_memory_request(MemoryScoresRequest.model_validate(body))
    assert [entry.task is not None for entry in plan.memory] == [True, True, False, False, False]
    assert [entry.task_of for entry in plan.memory] == [0, 1, 0, 1, 0]


async def test_the_client_asks_for_p_task_only_when_told(app_client: AppClient) -> None:
    """ScorerClient sends task_score only when true (a scorer older than it refuses unknown
    fields); P_task is the same on the naive path."""
    from mempo.api.scorer import MemoryTrajectory
    from mempo.clients.scorer import ScorerClient

    trajectory = MemoryTrajectory.model_validate(TRAJECTORY)
    sent: list[bytes] = []

    async def record(request: httpx.Request) -> None:
        sent.append(request.read())

    p_task = {}
    for method in ("shared", "naive"):
        async with app_client(method=method) as http:
            http.event_hooks["request"] = [record]
            client = ScorerClient("http://scorer", attempts=1, client=http)
            plain = await client.memory_scores([trajectory])
            asked = await client.memory_scores([trajectory, trajectory], task_score=True)
        assert plain.results[0].p_task is None
        assert asked.results[0].p_task == asked.results[1].p_task is not None
        p_task[method] = asked.results[0].p_task
    assert [b"task_score" in body for body in sent] == [False, True, False, True]
    assert p_task["shared"] == pytest.approx(p_task["naive"], rel=1e-4)
