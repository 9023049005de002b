"""Publishing by broadcast (``weight_sync = broadcast``): two real CPU engines get the
tensors over gloo, paused around it; the scorer and an engine that cannot take a
broadcast get the same version from disk; every engine ends on one whole version."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from safetensors.torch import load_file

from mempo.keys import Keys
from mempo.procs import free_port
from mempo.queue import RedisQueue
from mempo.registry import EngineInfo
from mempo.weights import write_safetensors
from services.learner.broadcast import WeightBroadcaster
from services.learner.publish import WeightPublisher
from services.rollout.engine.inprocess import EngineThread
from tests.services.learner.service_support import StandInEngine, serving
from tests.services.rollout.test_engine_support import ADMIN, engine_settings, generate

PROMPT = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}


class TensorExporter:
    """The tiny model plus noise of one seed, in memory and as an HF folder."""

    def __init__(self, base: Path, seed: int) -> None:
        self.base = base
        generator = torch.Generator().manual_seed(seed)
        state = load_file(str(base / "model.safetensors"))
        self.state = {n: t + 0.3 * t.std() * torch.randn(t.shape, generator=generator) for n, t in state.items()}

    def export_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def export_hf(self, out_dir: Path) -> Path:
        shutil.copy(self.base / "config.json", out_dir / "config.json")
        write_safetensors(self.state, out_dir / "model.safetensors")
        return out_dir


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], Path]]:
    root = tmp_path_factory.mktemp("weights")
    with (
        EngineThread(engine_settings(tiny_model_dir, weights_root=str(root))) as a,
        EngineThread(engine_settings(tiny_model_dir, weights_root=str(root))) as b,
    ):
        yield [a, b], root


def version(url: str) -> str:
    return str(httpx.get(f"{url}/model_info").json()["weight_version"])


async def test_a_broadcast_publish_reaches_the_engines_and_the_rest_load_from_disk(
    redis_client: object, keys: Keys, tiny_model_dir: Path, engines: tuple[list[str], Path]
) -> None:
    urls, root = engines
    scorer, old = StandInEngine("scorer", admin_token=ADMIN), StandInEngine("old", admin_token=ADMIN)
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    with serving([scorer.app(), old.app()]) as (scorer.url, old.url):
        for i, url in enumerate(urls):
            await queue.register_engine(EngineInfo(id=f"engine-{i}", role="rollout", url=url).signed(ADMIN))
        await queue.register_engine(EngineInfo(id="scorer", role="scorer", url=scorer.url).signed(ADMIN))
        # an engine that speaks only /update_weights_from_disk: it cannot be paused
        await queue.register_engine(EngineInfo(id="old", role="rollout", url=old.url).signed(ADMIN))
        publisher = WeightPublisher(
            queue, root, admin_token=ADMIN, timeout_s=30, broadcast=True,
            broadcast_options={"bucket_bytes": 256 * 1024},
        )  # fmt: skip
        try:
            first = await publisher.publish(TensorExporter(tiny_model_dir, seed=1), version=1)
            second = await publisher.publish(TensorExporter(tiny_model_dir, seed=2), version=2)
        finally:
            await publisher.aclose()
    for report in (first, second):
        assert report.stale == {}, report.stale
        assert report.paths == {urls[0]: "broadcast", urls[1]: "broadcast", scorer.url: "disk", old.url: "disk"}
        assert report.broadcast_s > 0 and report.export_s > 0
    assert [version(u) for u in urls] == ["2", "2"] and scorer.weight_version == old.weight_version == "2"
    assert [c["weight_version"] for c in old.calls] == ["1", "2"]
    broadcast_ids = generate(urls[0], PROMPT)["output_ids"]
    assert generate(urls[1], PROMPT)["output_ids"] == broadcast_ids
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ADMIN}"}) as http:
        loaded = await http.post(f"{urls[1]}/update_weights_from_disk", json={"model_path": str(root / "v2"), "weight_version": "2d"})
        assert loaded.status_code == 200, loaded.text
    assert generate(urls[1], PROMPT)["output_ids"] == broadcast_ids  # what the disk holds
    assert not httpx.get(f"{urls[0]}/server_info").json()["paused"]  # resumed after


async def test_the_weight_group_store_listens_on_weight_sync_address_only(
    tiny_model_dir: Path, engines: tuple[list[str], Path]
) -> None:
    """The learner's store (and so its weight group) accepts connections on
    ``master_address`` only, not on every interface."""
    psutil = pytest.importorskip("psutil")
    urls, _ = engines
    port = free_port()  # MEMPO_LEARNER_WEIGHT_SYNC_PORT
    async with httpx.AsyncClient(timeout=60) as http:
        broadcaster = WeightBroadcaster(http, lambda _: ADMIN, master_address="127.0.0.1", port=port, timeout_s=30)
        try:
            errors = await broadcaster.push(TensorExporter(tiny_model_dir, seed=3).export_tensors(), 3, urls)
            assert errors == dict.fromkeys(urls), errors
            listening = [  # the group stays for the next push
                c.laddr for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port
            ]  # fmt: skip
            assert [address.ip for address in listening] == ["127.0.0.1"], listening
        finally:
            await broadcaster.close()


def refusing_engine() -> FastAPI:
    """An engine that can be paused but refuses every weight group."""
    app = FastAPI()

    @app.post("/pause_generation")
    @app.post("/continue_generation")
    async def control() -> dict[str, Any]:
        return {"success": True, "message": "ok"}

    @app.post("/init_weights_update_group")
    @app.post("/destroy_weights_update_group")
    async def refuse() -> JSONResponse:
        return JSONResponse({"success": False, "message": "no group here"}, 400)

    return app


async def test_an_engine_that_cannot_join_does_not_hold_the_push(
    tiny_model_dir: Path, engines: tuple[list[str], Path]
) -> None:
    """The learner gives its group up at the first engine that cannot join, instead of
    waiting the whole timeout for it; the push reports it (the publisher then brings the
    engines the version from disk)."""
    urls, _ = engines
    with serving([refusing_engine()]) as (refuser,):
        async with httpx.AsyncClient(timeout=60) as http:
            broadcaster = WeightBroadcaster(http, lambda _: ADMIN, timeout_s=30)
            started = time.monotonic()
            try:
                errors = await broadcaster.push(TensorExporter(tiny_model_dir, seed=4).export_tensors(), 4, [*urls, refuser])
            finally:
                await broadcaster.close()
            assert time.monotonic() - started < 10, errors
    assert errors[refuser] and "no group here" in errors[refuser], errors
    assert all(errors[u] for u in urls), errors  # none got the version by broadcast
    assert {version(u) for u in urls} != {"4"}
    async with httpx.AsyncClient(timeout=60) as http:  # and they take the next group
        broadcaster = WeightBroadcaster(http, lambda _: ADMIN, timeout_s=30)
        try:
            errors = await broadcaster.push(TensorExporter(tiny_model_dir, seed=5).export_tensors(), 5, urls)
        finally:
            await broadcaster.close()
    assert errors == dict.fromkeys(urls), errors
    assert [version(u) for u in urls] == ["5", "5"]


async def test_a_stopping_learner_resumes_engines_a_broadcast_left_paused_on_the_published_version(
    redis_client: object, keys: Keys, tiny_model_dir: Path, engines: tuple[list[str], Path]
) -> None:
    """A learner stopped in the middle of a broadcast once left its engines paused (on part
    of a version) until a learner published again."""
    urls, root = engines
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    await queue.register_engine(EngineInfo(id="engine-0", role="rollout", url=urls[0]).signed(ADMIN))
    publisher = WeightPublisher(queue, root, admin_token=ADMIN, timeout_s=30, broadcast=True)
    try:
        await publisher.publish(TensorExporter(tiny_model_dir, seed=5), version=5)
        published = generate(urls[0], PROMPT)["output_ids"]
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ADMIN}"}) as http:
            shutil.copytree(tiny_model_dir, root / "part", dirs_exist_ok=True)  # stands in for half a version
            body = {"model_path": str(root / "part"), "weight_version": "5-part"}
            assert (await http.post(f"{urls[0]}/update_weights_from_disk", json=body)).status_code == 200
            assert (await http.post(f"{urls[0]}/pause_generation", json={"mode": "retract"})).status_code == 200
        assert httpx.get(f"{urls[0]}/server_info").json()["paused"]
        assert publisher.broadcaster is not None
        publisher.broadcaster.held = {urls[0]}  # what an interrupted push leaves
    finally:
        await publisher.aclose()
    assert not httpx.get(f"{urls[0]}/server_info").json()["paused"]
    assert version(urls[0]) == "5" and generate(urls[0], PROMPT)["output_ids"] == published
