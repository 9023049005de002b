"""The CPU engine's weight broadcast routes (SGLang's /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group) over gloo, this test
playing the learner (rank 0): the broadcast loads exactly what a disk update of the same
weights loads, in flattened buckets or tensor by tensor; a bucket that does not fit the
model is refused before anything is received, one with NaN after, the old weights kept."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from mempo.clients.engine import EngineClient, EngineError
from mempo.procs import free_port
from mempo.weight_sync import FLATTENED, broadcast, buckets, dtype_name, flatten, join_group
from services.rollout.engine.inprocess import EngineThread
from tests.services.rollout.test_engine_support import (
    ADMIN,
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


async def push(
    client: EngineClient, state: dict[str, torch.Tensor], weight_version: str,
    bucket_bytes: int, load_format: str | None = FLATTENED,
) -> None:  # fmt: skip
    """Join a group with the engine (rank 1 of 2), broadcast ``state``, leave the group."""
    port = free_port()
    joined = asyncio.create_task(client.init_weights_update_group("127.0.0.1", port, 1, 2))
    group = await asyncio.to_thread(join_group, "127.0.0.1", port, 0, 2, timeout_s=20)
    assert (await joined).success
    parts = buckets(sorted(state.items()), bucket_bytes)
    for i, bucket in enumerate(parts):
        names, dtypes = [n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket]
        last = weight_version if i == len(parts) - 1 else None
        told = client.update_weights_from_distributed(
            names, dtypes, [list(t.shape) for _, t in bucket], last, load_format=load_format
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
        port = free_port()
        joined = asyncio.create_task(client.init_weights_update_group("127.0.0.1", port, 1, 2))
        group = await asyncio.to_thread(join_group, "127.0.0.1", port, 0, 2, timeout_s=20)
        assert (await joined).success
        for names, dtypes, shapes, why in [
            (["no.such.weight"], ["float32"], [[4]], "unexpected tensor"),
            ([name], ["float32"], [[3, 3]], "shape"),
            ([name], ["int64"], [list(tensor.shape)], "not a floating dtype"),
            ([name], ["complex_float"], [list(tensor.shape)], "not a torch dtype"),
            ([name, name], ["float32"] * 2, [list(tensor.shape)] * 2, "named twice"),
        ]:
            with pytest.raises(EngineError, match=why):
                await client.update_weights_from_distributed(names, dtypes, shapes, "bad")
        poisoned = tensor.clone()
        poisoned.view(-1)[3] = float("nan")
        call = asyncio.create_task(client.update_weights_from_distributed(
            [name], ["float32"], [list(tensor.shape)], "nan"))  # fmt: skip
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
