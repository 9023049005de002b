"""The CPU engine's admin and ops routes: auth, weight updates, pause, abort, health,
and a clean shutdown of the scheduler thread."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from mempo.procs import free_port, wait_ready
from services.rollout.engine.inprocess import EngineThread
from services.rollout.engine.model import ModelRunner
from services.rollout.engine.runtime import EngineRuntime
from services.rollout.engine.sequence import Sequence, SequenceSpec
from tests.services.rollout.test_engine_support import (
    ADMIN_HEADERS,
    engine_settings,
    generate,
    perturbed_copy,
    sampled,
)

GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
ADMIN_ROUTES = [
    ("/update_weights_from_disk", {"model_path": "/nowhere"}),
    ("/flush_cache", {}),
    ("/pause_generation", {"mode": "in_place"}),
    ("/continue_generation", {}),
    ("/abort_request", {"rid": "x"}),
]


@pytest.fixture(scope="module")
def weights_root(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights")
    perturbed_copy(tiny_model_dir, root / "v0", seed=0, scale=0.0)  # the original weights
    perturbed_copy(tiny_model_dir, root / "v1", seed=1)
    (root / "empty").mkdir()
    bad = perturbed_copy(tiny_model_dir, root / "bad_shape", seed=2) / "model.safetensors"
    save_file({**load_file(str(bad)), "model.norm.weight": torch.ones(7)}, str(bad))
    return root


@pytest.fixture(scope="module")
def url(weights_root: Path) -> Iterator[str]:
    settings = engine_settings(weights_root / "v0", weights_root=str(weights_root))
    with EngineThread(settings) as base:
        yield base


def admin(
    url: str, path: str, body: Any, headers: dict[str, str] = ADMIN_HEADERS
) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def long_body(rid: str, tokens: int = 200) -> dict[str, Any]:
    return {"input_ids": [5, 6, 7], "rid": rid, "sampling_params": sampled(tokens, 0)}


@pytest.mark.parametrize(("path", "body"), ADMIN_ROUTES)
def test_admin_routes_need_the_token(url: str, path: str, body: Any) -> None:
    assert admin(url, path, body, headers={}).status_code == 401
    assert admin(url, path, body, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_weight_update_changes_outputs_and_version(url: str, weights_root: Path) -> None:
    prompt = {"input_ids": [11, 12, 13, 14], "sampling_params": GREEDY}
    before = generate(url, prompt)
    reply = admin(
        url,
        "/update_weights_from_disk",
        {"model_path": str(weights_root / "v1"), "weight_version": "1"},
    )
    assert reply.status_code == 200 and reply.json()["success"] is True
    after = generate(url, prompt)
    assert after["meta_info"]["weight_version"] == "1"
    assert after["output_ids"] != before["output_ids"]
    info = httpx.get(f"{url}/model_info").json()
    assert info["weight_version"] == "1" and info["model_path"] == str(weights_root / "v1")
    assert httpx.get(f"{url}/get_model_info").json()["weight_version"] == "1"
    back = admin(
        url,
        "/update_weights_from_disk",
        {"model_path": str(weights_root / "v0"), "weight_version": "2"},
    )
    assert back.json()["success"] is True
    assert generate(url, prompt)["output_ids"] == before["output_ids"]


@pytest.mark.parametrize("folder", ["empty", "bad_shape", "missing"])
def test_unloadable_weights_are_refused(url: str, weights_root: Path, folder: str) -> None:
    version = httpx.get(f"{url}/model_info").json()["weight_version"]
    reply = admin(
        url,
        "/update_weights_from_disk",
        {"model_path": str(weights_root / folder), "weight_version": "9"},
    )
    assert reply.status_code == 400 and reply.json()["success"] is False
    assert httpx.get(f"{url}/model_info").json()["weight_version"] == version


def test_weights_outside_the_root_are_forbidden(
    url: str, tiny_model_dir: Path, weights_root: Path
) -> None:
    for path in (str(tiny_model_dir), str(weights_root / ".." / "elsewhere")):
        reply = admin(url, "/update_weights_from_disk", {"model_path": path})
        assert reply.status_code == 403 and "weights root" in reply.json()["message"]
    assert admin(url, "/update_weights_from_disk", {"model_path": ""}).status_code == 400


async def test_update_waits_for_in_flight_requests_or_aborts_them(
    url: str, weights_root: Path
) -> None:
    version = httpx.get(f"{url}/model_info").json()["weight_version"]
    async with httpx.AsyncClient(timeout=60, headers=ADMIN_HEADERS) as client:
        running = asyncio.create_task(client.post(f"{url}/generate", json=long_body("inflight")))
        await asyncio.sleep(0.15)
        update = await client.post(
            f"{url}/update_weights_from_disk",
            json={"model_path": str(weights_root / "v0"), "weight_version": "w"},
        )
        assert update.json()["success"] is True
        done = (await asyncio.wait_for(running, 5)).json()
        assert done["meta_info"]["finish_reason"]["type"] == "length"
        assert done["meta_info"]["weight_version"] == version  # finished on the old weights

        running = asyncio.create_task(
            client.post(f"{url}/generate", json=long_body("doomed", 4000 - 3))
        )
        await asyncio.sleep(0.15)
        body = {
            "model_path": str(weights_root / "v0"),
            "weight_version": "x",
            "abort_all_requests": True,
        }
        assert (await client.post(f"{url}/update_weights_from_disk", json=body)).json()[
            "success"
        ] is True
        aborted = (await running).json()
        assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < aborted["meta_info"]["completion_tokens"] < 3997


async def test_pause_in_place_holds_requests_until_continue(url: str) -> None:
    async with httpx.AsyncClient(timeout=60, headers=ADMIN_HEADERS) as client:
        running = asyncio.create_task(client.post(f"{url}/generate", json=long_body("held", 300)))
        await asyncio.sleep(0.1)
        paused = await client.post(f"{url}/pause_generation", json={"mode": "in_place"})
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        assert (await client.get(f"{url}/ready")).status_code == 503
        waiting = asyncio.create_task(client.post(f"{url}/generate", json=long_body("later", 5)))
        await asyncio.sleep(0.5)
        assert not running.done() and not waiting.done()
        assert (await client.post(f"{url}/flush_cache")).status_code == 400  # requests are held
        assert (await client.post(f"{url}/continue_generation", json={})).status_code == 200
        held, later = (await running).json(), (await waiting).json()
        assert held["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
        assert later["meta_info"]["completion_tokens"] == 5
        assert (await client.get(f"{url}/ready")).status_code == 200


async def test_pause_abort_and_abort_request(url: str) -> None:
    async with httpx.AsyncClient(timeout=60, headers=ADMIN_HEADERS) as client:
        running = asyncio.create_task(client.post(f"{url}/generate", json=long_body("p", 3000)))
        await asyncio.sleep(0.15)
        assert (
            await client.post(f"{url}/pause_generation", json={})
        ).status_code == 200  # mode abort
        assert (await running).json()["meta_info"]["finish_reason"]["type"] == "abort"
        await client.post(f"{url}/continue_generation", json={})

        batch = {"input_ids": [[5, 6], [7, 8]], "rid": "job", "sampling_params": sampled(3000, 0)}
        other = asyncio.create_task(client.post(f"{url}/generate", json=long_body("keep", 30)))
        running = asyncio.create_task(client.post(f"{url}/generate", json=batch))
        await asyncio.sleep(0.15)
        assert (await client.post(f"{url}/abort_request", json={"rid": "job"})).status_code == 200
        results = (await running).json()
        assert [r["meta_info"]["finish_reason"]["type"] for r in results] == ["abort", "abort"]
        assert [r["meta_info"]["id"] for r in results] == ["job_0", "job_1"]
        assert (await other).json()["meta_info"]["finish_reason"]["type"] == "length"

        running = asyncio.create_task(client.post(f"{url}/generate", json=long_body("any", 3000)))
        await asyncio.sleep(0.15)
        await client.post(f"{url}/abort_request", json={"abort_all": True})
        assert (await running).json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_ops_routes(url: str) -> None:
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert httpx.get(f"{url}/health_generate").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200
    flushed = admin(url, "/flush_cache", {})
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    info = httpx.get(f"{url}/server_info").json()
    assert info["context_length"] == 8192 and info["max_batch_size"] == 32
    assert httpx.get(f"{url}/get_server_info").json()["context_length"] == 8192
    schema = httpx.get(f"{url}/openapi.json")
    assert schema.status_code == 200 and "/generate" in schema.json()["paths"]
    metrics = httpx.get(f"{url}/metrics").text
    for name in (
        "mempo_engine_generated_tokens_total",
        "mempo_engine_prompt_tokens_total",
        "mempo_engine_decode_batch_rows_bucket",
        "mempo_engine_running_requests",
    ):
        assert name in metrics


def test_runtime_shutdown_aborts_in_flight_and_joins(tiny_model_dir: Path) -> None:
    runner = ModelRunner.load(tiny_model_dir)
    runtime = EngineRuntime(runner, AutoTokenizer.from_pretrained(tiny_model_dir))
    runtime.start()
    finished = threading.Event()
    seq = Sequence(
        SequenceSpec(rid="s", prompt_ids=[5, 6], max_new_tokens=7000), lambda s: finished.set()
    )
    runtime.submit([seq])
    time.sleep(0.2)
    started = time.monotonic()
    runtime.close(drain_timeout_s=0.2)
    assert finished.is_set() and seq.finish_reason is not None
    assert seq.finish_reason["type"] == "abort" and 0 < len(seq.output_ids) < 7000
    assert not runtime.alive and time.monotonic() - started < 5
    with pytest.raises(Exception, match="shutting down"):
        runtime.submit(
            [Sequence(SequenceSpec(rid="t", prompt_ids=[5], max_new_tokens=1), lambda s: None)]
        )


def test_a_client_that_disconnects_aborts_its_generation(url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(long_body("gone", 7000)).encode()
    head = f"POST /generate HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head.encode() + body)
        time.sleep(0.3)
        assert httpx.get(f"{url}/server_info").json()["internal_states"][0]["running"] == 1
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/server_info").json()["internal_states"][0]["running"]:
        assert time.monotonic() < deadline, "the generation outlived its client"
        time.sleep(0.05)


def test_a_client_that_leaves_during_a_long_prefill_stops_it_within_a_chunk(url: str) -> None:
    """12 prompts of 7,000 ids (about 15 s as one prefill forward here): prefilled 2 at a
    time (max_prefill_tokens 16,384), the chunks after the client left never run."""
    port = int(url.rsplit(":", 1)[1])
    before = httpx.get(f"{url}/server_info").json()["internal_states"][0]["prefill_batches"]
    prompts = [[5 + i] * 7000 for i in range(12)]
    body = json.dumps(
        {"input_ids": prompts, "rid": "long", "sampling_params": sampled(1, 0)}
    ).encode()
    head = f"POST /generate HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head.encode() + body)
        time.sleep(0.5)
    left = time.monotonic()
    while True:
        state = httpx.get(f"{url}/server_info", timeout=30).json()["internal_states"][0]
        if not state["running"] and not state["waiting"]:
            break
        assert time.monotonic() - left < 10, f"the prefill outlived its client: {state}"
        time.sleep(0.05)
    assert state["prefill_batches"] - before <= 3  # of 6 chunks


def test_the_cli_serves_an_engine_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "MEMPO_ENGINE_ADMIN_TOKEN": "cli-token-0123456789abcdef",
        "MEMPO_ENGINE_THREADS": "1",
    }
    args = ["rollout", "engine", "--port", str(port), "--model-path", str(tiny_model_dir)]
    log = (tmp_path / "engine.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mempo_cli", *args], env=env, stdout=log, stderr=log
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, timeout_s=120, proc=proc)
        out = generate(base, {"input_ids": [5, 6], "sampling_params": GREEDY})
        assert out["meta_info"]["completion_tokens"] == 12
        assert httpx.post(f"{base}/flush_cache").status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    text = (tmp_path / "engine.log").read_text()
    assert code in (0, -signal.SIGTERM), text  # uvicorn re-raises SIGTERM once it has shut down
    assert "engine scheduler stopped" in text and "Finished server process" in text


def test_a_finished_sequence_frees_its_rid_while_the_scheduler_still_holds_it(
    tiny_model_dir: Path,
) -> None:
    """The answer of a request may be sent before the scheduler drops its sequence: the
    same rid sent right then is new, not a duplicate (it was refused under load)."""
    from services.rollout.engine.runtime import DuplicateRequestId

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    runtime = EngineRuntime(
        ModelRunner.load(tiny_model_dir), tok
    )  # not started: nothing is dropped

    def seq(rid: str) -> Sequence:
        return Sequence(SequenceSpec(rid=rid, prompt_ids=[5, 6], max_new_tokens=1), lambda s: None)

    first = seq("same")
    runtime.submit([first, seq("busy")])
    with pytest.raises(DuplicateRequestId):
        runtime.submit([seq("same")])
    first.finish({"type": "stop", "matched": 2}, tok)  # answered, still queued in the runtime
    runtime.submit([seq("same")])
    with pytest.raises(DuplicateRequestId):
        runtime.submit([seq("busy")])
