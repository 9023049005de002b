"""The CPU engine's weight broadcast routes (SGLang's /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group) over gloo, this test
playing the learner (rank 0): the broadcast loads exactly what a disk update of the same
weights loads, in flattened buckets or tensor by tensor; a bucket that does not fit the
model, or is not the size the learner announced, is refused before anything is received
(the engine leaves the group), one with NaN after, the old weights kept. A join answers
within the engine's weight_sync_timeout_s whatever the learner's end does, a newer join
replaces one in progress at once, and an engine is in one group at most."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from mempo.clients.engine import EngineClient, EngineError
from mempo.procs import free_port, wait_ready
from mempo.weight_buckets import buckets, dtype_name, flatten
from mempo.weight_sync import (
    FLATTENED,
    WeightGroup,
    announce_bucket,
    broadcast,
    join_group,
    listen_socket,
)
from services.rollout.engine.inprocess import EngineThread
from tests.services.rollout.test_engine_support import (
    ADMIN,
    ADMIN_HEADERS,
    engine_settings,
    generate,
    perturbed_copy,
)

GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
PROMPT = {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY}


@pytest.fixture(scope="module")
def weights_root(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights")
    perturbed_copy(tiny_model_dir, root / "v0", seed=0, scale=0.0)
    perturbed_copy(tiny_model_dir, root / "v1", seed=1)
    return root


@pytest.fixture(scope="module")
def url(weights_root: Path) -> Iterator[str]:
    settings = engine_settings(weights_root / "v0", weights_root=str(weights_root), weight_sync_timeout_s=20)
    with EngineThread(settings) as base:
        yield base


def version(url: str) -> str:
    return str(httpx.get(f"{url}/model_info").json()["weight_version"])


async def from_disk(client: EngineClient, folder: Path, version: str) -> None:
    assert (await client.update_weights_from_disk(str(folder), version)).success


async def join(client: EngineClient, name: str = "weight_update_group") -> WeightGroup:
    """A group of this test (rank 0, its store on 127.0.0.1 only) and the engine (rank 1)."""
    listening = listen_socket("127.0.0.1")
    port = listening.getsockname()[1]
    joined = asyncio.create_task(client.init_weights_update_group("127.0.0.1", port, 1, 2, name))
    try:
        group = await asyncio.to_thread(
            join_group, "127.0.0.1", port, 0, 2, name, timeout_s=20, listen=listening
        )
    finally:
        listening.close()
    assert (await joined).success
    return group


@asynccontextmanager
async def joined(client: EngineClient) -> AsyncIterator[WeightGroup]:
    group = await join(client)
    try:
        yield group
    finally:
        del group
        gc.collect()


async def push(
    client: EngineClient, state: dict[str, torch.Tensor], weight_version: str,
    bucket_bytes: int, load_format: str | None = FLATTENED,
) -> None:  # fmt: skip
    """Join a group with the engine (rank 1 of 2), broadcast ``state``, leave the group."""
    group = await join(client)
    parts = buckets(sorted(state.items()), bucket_bytes)
    for i, bucket in enumerate(parts):
        names, dtypes = [n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        last = weight_version if i == len(parts) - 1 else None
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        announce_bucket(group, names, dtypes, shapes, load_format, size)
        told = client.update_weights_from_distributed(
            names, dtypes, shapes, last, load_format=load_format
        )
        call = asyncio.create_task(told)
        if load_format == FLATTENED:
            await asyncio.to_thread(broadcast, group, flatten(bucket))
        else:
            for _, tensor in bucket:
                await asyncio.to_thread(broadcast, group, tensor.contiguous())
        assert (await call).success
    assert (await client.destroy_weights_update_group()).success


@pytest.mark.parametrize("load_format", [FLATTENED, None])
async def test_a_broadcast_loads_what_the_disk_path_loads(
    url: str, weights_root: Path, load_format: str | None
) -> None:
    state = load_file(str(weights_root / "v1" / "model.safetensors"))
    async with EngineClient(url, admin_token=ADMIN) as client:
        await from_disk(client, weights_root / "v0", "0")
        before = generate(url, PROMPT)["output_ids"]
        await push(client, state, "b1", bucket_bytes=64 * 1024, load_format=load_format)
        assert len(buckets(sorted(state.items()), 64 * 1024)) > 2  # several buckets
        assert version(url) == "b1"
        broadcast_ids = generate(url, PROMPT)["output_ids"]
        await from_disk(client, weights_root / "v1", "1")
        assert generate(url, PROMPT)["output_ids"] == broadcast_ids != before


async def test_a_bucket_that_does_not_fit_is_refused_before_it_is_received(
    url: str, weights_root: Path
) -> None:
    state = load_file(str(weights_root / "v1" / "model.safetensors"))
    name, tensor = sorted(state.items())[0]
    async with EngineClient(url, admin_token=ADMIN) as client:
        with pytest.raises(EngineError, match="init_weights_update_group"):
            await client.update_weights_from_distributed([name], ["float32"], [list(tensor.shape)])
        for names, dtypes, shapes, why in [
            (["no.such.weight"], ["float32"], [[4]], "unexpected tensor"),
            ([name], ["float32"], [[3, 3]], "shape"),
            ([name], ["int64"], [list(tensor.shape)], "not a floating dtype"),
            ([name], ["complex_float"], [list(tensor.shape)], "not a torch dtype"),
            ([name, name], ["float32"] * 2, [list(tensor.shape)] * 2, "named twice"),
        ]:
            async with joined(client):  # a refused bucket: the engine leaves the group
                with pytest.raises(EngineError, match=why):
                    await client.update_weights_from_distributed(names, dtypes, shapes, "bad")
                with pytest.raises(EngineError, match="does not exist"):
                    await client.destroy_weights_update_group()
        async with joined(client) as group:
            poisoned = tensor.clone()
            poisoned.view(-1)[3] = float("nan")
            shape = [list(tensor.shape)]
            announce_bucket(group, [name], ["float32"], shape, FLATTENED, tensor.numel() * 4)
            call = asyncio.create_task(
                client.update_weights_from_distributed([name], ["float32"], shape, "nan")
            )
            await asyncio.to_thread(broadcast, group, flatten([(name, poisoned)]))
            with pytest.raises(EngineError, match="NaN"):
                await call
            assert version(url) not in ("bad", "nan")
            assert (await client.destroy_weights_update_group()).success
            with pytest.raises(EngineError, match="does not exist"):
                await client.destroy_weights_update_group()


async def test_the_group_routes_need_the_admin_token_and_a_usable_backend(url: str) -> None:
    body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    assert httpx.post(f"{url}/init_weights_update_group", json=body).status_code == 401
    async with EngineClient(url, admin_token=ADMIN) as client:
        with pytest.raises(EngineError, match="nccl needs CUDA"):
            await client.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="nccl")
        with pytest.raises(EngineError, match="outside a world of 2"):
            await client.init_weights_update_group("127.0.0.1", free_port(), 2, 2)


JOIN_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def quick_url(weights_root: Path) -> Iterator[str]:
    """An engine whose joins give up after JOIN_TIMEOUT_S."""
    settings = engine_settings(
        weights_root / "v0", weights_root=str(weights_root), weight_sync_timeout_s=JOIN_TIMEOUT_S
    )
    with EngineThread(settings) as base:
        yield base


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers on them (nor closes them)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with server:
            while True:
                try:
                    held.append(server.accept()[0])
                except OSError:  # closed: the test is over
                    return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.close()
    for conn in held:
        conn.close()


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def join_route(url: str, port: int, name: str, timeout: float = 15.0) -> tuple[int, str, float]:
    """POST /init_weights_update_group: status, message and seconds taken."""
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": name, "backend": "gloo"}  # fmt: skip
    started = time.monotonic()
    reply = httpx.post(
        f"{url}/init_weights_update_group", json=body, headers=ADMIN_HEADERS, timeout=timeout
    )
    return reply.status_code, reply.json()["message"], time.monotonic() - started


async def test_a_join_gives_up_within_its_timeout_whatever_the_peer_does(
    quick_url: str, silent_port: int
) -> None:
    closed = free_port()  # nothing listens there
    for port, name in [(silent_port, "silent"), (closed, "closed")]:
        status, message, seconds = await asyncio.to_thread(join_route, quick_url, port, name)
        assert status == 400 and "Failed to initialize" in message, message
        assert seconds < JOIN_TIMEOUT_S + 1.5, (name, seconds)
    # and nothing of them holds the engine: a learner joins it at once, then pushes a bucket
    started = time.monotonic()
    async with EngineClient(quick_url, admin_token=ADMIN) as client, joined(client):
        assert time.monotonic() - started < 2.0
        assert (await client.destroy_weights_update_group()).success


async def test_a_newer_join_replaces_one_in_progress(url: str, silent_port: int) -> None:
    # the engine's joins give up after 20 s: the one to the silent port would hold it that long
    stuck = asyncio.create_task(asyncio.to_thread(join_route, url, silent_port, "stuck", 30.0))
    await asyncio.sleep(0.5)
    started = time.monotonic()
    async with EngineClient(url, admin_token=ADMIN) as client, joined(client):
        assert time.monotonic() - started < 5.0
        status, message, seconds = await stuck
        assert status == 400 and "replaced by a newer join" in message, message
        assert seconds < 6.0
        assert (await client.destroy_weights_update_group()).success


async def test_an_engine_is_in_one_group_at_most(url: str, weights_root: Path) -> None:
    state = load_file(str(weights_root / "v1" / "model.safetensors"))
    name, tensor = sorted(state.items())[0]
    async with EngineClient(url, admin_token=ADMIN) as client:
        counts = []
        for i in range(6):  # a group each, none destroyed: each replaces the one before
            group = await join(client, f"group-{i}")
            del group  # this end of it (the test's store and gloo threads) goes
            gc.collect()
            await asyncio.sleep(0.2)
            counts.append(threads())
        assert counts[-1] <= counts[0] + 1, counts
        with pytest.raises(EngineError, match="not in"):  # replaced
            await client.update_weights_from_distributed([name], ["float32"], [list(tensor.shape)], group_name="group-0")
        assert (await client.destroy_weights_update_group("group-5")).success


@pytest.fixture(scope="module")
def engine_process(
    weights_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """An engine in a process of its own (gloo aborts the process it fails in)."""
    port = free_port()
    env = {
        **os.environ, "MEMPO_ENGINE_ADMIN_TOKEN": ADMIN, "MEMPO_ENGINE_THREADS": "1",
        "MEMPO_ENGINE_WEIGHT_SYNC_TIMEOUT_S": "5", "MEMPO_ENGINE_WEIGHTS_ROOT": str(weights_root),
    }  # fmt: skip
    args = ["rollout", "engine", "--port", str(port), "--model-path", str(weights_root / "v0")]
    log_path = tmp_path_factory.mktemp("engine") / "engine.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mempo_cli", *args], env=env, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, timeout_s=120, proc=proc)
        yield base, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.parametrize("extra", [-4096, 4096])
async def test_a_bucket_of_other_bytes_than_declared_is_refused_and_the_engine_lives(
    engine_process: tuple[str, subprocess.Popen[bytes]], weights_root: Path, extra: int
) -> None:
    """A learner that broadcasts 4 KiB fewer or more bytes than its request declares:
    refused before the receive is posted (gloo would load the stale tail of the buffer,
    or abort the process), whether the learner announced the bytes it sends or, like a
    plain SGLang sender, announced nothing; the old weights keep serving."""
    url, proc = engine_process
    state = load_file(str(weights_root / "v1" / "model.safetensors"))
    name, tensor = max(state.items(), key=lambda item: item[1].numel())
    declared = tensor.numel() * tensor.element_size()
    payload = torch.ones(declared + extra, dtype=torch.uint8)
    before, held = generate(url, PROMPT)["output_ids"], version(url)
    async with EngineClient(url, admin_token=ADMIN) as client:
        for announced, why in [(True, "broadcasts .* bytes"), (False, "not announced")]:
            async with joined(client) as group:
                shape = [list(tensor.shape)]
                if announced:  # what it sends, not what it declares
                    announce_bucket(group, [name], ["float32"], shape, FLATTENED, payload.numel())
                call = asyncio.create_task(
                    client.update_weights_from_distributed([name], ["float32"], shape, "bad")
                )
                sent = asyncio.create_task(asyncio.to_thread(broadcast, group, payload))
                with pytest.raises(EngineError, match=why) as refused:
                    await call
                assert refused.value.status_code == 400
                with pytest.raises(RuntimeError):  # the engine left the group
                    await asyncio.wait_for(sent, 10)
            assert proc.poll() is None, "the engine process died"
            assert httpx.get(f"{url}/health").status_code == 200
            assert version(url) == held
            assert generate(url, PROMPT)["output_ids"] == before
