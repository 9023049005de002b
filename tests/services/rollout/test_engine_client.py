"""mempo.clients.engine against a live engine over real HTTP: the CPU engine always, and a
real SGLang server (marked gpu) when sglang and CUDA are present; plus stand-in servers
for route fallbacks and retries."""

from __future__ import annotations

import asyncio
import importlib.util
import string
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from mempo.clients.engine import ContextExceeded, EngineClient, EngineError
from mempo.procs import free_port, wait_ready
from services.rollout.engine.inprocess import EngineThread
from tests.services.rollout.test_engine_support import ADMIN, engine_settings, perturbed_copy

STOPS = [*string.ascii_letters, *string.digits, " "]  # nearly every token holds one
MAX_POSITIONS = 8192  # the tiny model's context


@dataclass(frozen=True)
class LiveEngine:
    url: str
    admin_token: str | None
    weights_root: Path

    def client(self) -> EngineClient:
        return EngineClient(self.url, admin_token=self.admin_token, backoff_base_s=0.01)


@pytest.fixture(scope="module")
def weights_root(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("client-weights")
    perturbed_copy(tiny_model_dir, root / "v0", seed=0, scale=0.0)
    perturbed_copy(tiny_model_dir, root / "v1", seed=1)
    return root


def sglang_server(model: Path, weights_root: Path) -> Iterator[LiveEngine]:
    """A real SGLang server on the tiny model (GPU machines with sglang installed)."""
    import torch

    if importlib.util.find_spec("sglang") is None or not torch.cuda.is_available():
        pytest.skip("needs sglang and CUDA")
    port = free_port()
    args = [
        "--model-path",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--weight-version",
        "0",
        "--mem-fraction-static",
        "0.2",
        "--disable-cuda-graph",
        "--attention-backend",
        "triton",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", *args])
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=600, path="/health_generate", proc=proc)
        yield LiveEngine(f"http://127.0.0.1:{port}", None, weights_root)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module", params=["cpu", pytest.param("sglang", marks=pytest.mark.gpu)])
def engine(request: pytest.FixtureRequest, weights_root: Path) -> Iterator[LiveEngine]:
    if request.param == "sglang":
        yield from sglang_server(weights_root / "v0", weights_root)
        return
    settings = engine_settings(weights_root / "v0", weights_root=str(weights_root))
    with EngineThread(settings) as url:
        yield LiveEngine(url, ADMIN, weights_root)


def params(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "ignore_eos": True,
        **extra,
    }


async def test_token_in_token_out(engine: LiveEngine) -> None:
    async with engine.client() as client:
        [gen] = await client.generate([5, 6, 7, 8], params(16), rid="tok-1")
        assert len(gen.output_ids) == len(gen.logprobs) == 16
        assert all(isinstance(t, int) for t in gen.output_ids)
        assert all(lp <= 0.0 for lp in gen.logprobs)
        assert (gen.finish_type, gen.matched, gen.prompt_tokens, gen.rid) == (
            "length",
            None,
            4,
            "tok-1",
        )
        assert gen.weight_version == "0"
        samples = await client.generate([5, 6, 7, 8], params(4, n=3))
        assert len(samples) == 3 and all(len(s.output_ids) == 4 for s in samples)
        [scored] = await client.generate(
            [5, 6, 7, 8], {"max_new_tokens": 0, "temperature": 0.0}, logprob_start_len=1
        )
        assert scored.output_ids == [] and scored.input_logprobs is not None
        assert len(scored.input_logprobs) == 3 and scored.input_logprobs[0] is None


async def test_stop_string_is_restored(engine: LiveEngine, tokenizer: Any) -> None:
    async with engine.client() as client:
        for seed in range(3):
            [gen] = await client.generate([9, 10, 11 + seed], params(50, stop=STOPS))
            assert gen.finish_type == "stop" and isinstance(gen.matched, str)
            assert gen.text.endswith(gen.matched)
            decoded = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            assert gen.text == decoded[: decoded.find(gen.matched)] + gen.matched


async def test_info_and_health(engine: LiveEngine) -> None:
    async with engine.client() as client:
        info = await client.model_info()
        assert info.weight_version == "0" and info.is_generation
        assert Path(info.tokenizer_path or info.model_path).exists()
        assert "weight_version" in await client.server_info()
        assert await client.health()
        await client.flush_cache()  # idle: accepted


async def test_prompt_beyond_the_context_raises_context_exceeded(engine: LiveEngine) -> None:
    async with engine.client() as client:
        with pytest.raises(ContextExceeded) as caught:
            await client.generate([5] * (MAX_POSITIONS + 8), params(4))
        assert caught.value.status_code == 400


async def test_weight_update_pause_and_abort(engine: LiveEngine) -> None:
    async with engine.client() as client:
        result = await client.update_weights_from_disk(str(engine.weights_root / "v1"), "1")
        assert result.success
        assert (await client.model_info()).weight_version == "1"
        [gen] = await client.generate([5, 6], params(2))
        assert gen.weight_version == "1"

        await client.pause_generation("abort")
        await client.continue_generation()
        long = asyncio.create_task(client.generate([5, 6], params(4000), rid="client-abort"))
        await asyncio.sleep(0.3)
        await client.abort_request(rid="client-abort")
        [aborted] = await long
        assert aborted.finish_type == "abort" and len(aborted.output_ids) < 4000
        assert (await client.update_weights_from_disk(str(engine.weights_root / "v0"), "0")).success


# --------------------------------------------------------------------------- stand-ins


def standin(app: FastAPI, **kwargs: Any) -> EngineClient:
    transport = httpx.ASGITransport(app=app)
    return EngineClient(
        "http://standin",
        client=httpx.AsyncClient(transport=transport),
        backoff_base_s=0.001,
        backoff_cap_s=0.01,
        **kwargs,
    )


GENERATED = {
    "text": "x",
    "output_ids": [3],
    "meta_info": {
        "id": "r",
        "finish_reason": {"type": "stop", "matched": "</search>"},
        "prompt_tokens": 2,
        "completion_tokens": 1,
        "weight_version": "7",
        "output_token_logprobs": [[-0.5, 3, None]],
    },
}


async def test_model_info_falls_back_to_the_old_route() -> None:
    app = FastAPI()

    @app.get("/get_model_info")
    async def old() -> dict[str, Any]:
        return {
            "model_path": "/m",
            "tokenizer_path": "/m",
            "is_generation": True,
            "weight_version": "3",
        }

    @app.get("/get_server_info")
    async def old_server() -> dict[str, Any]:
        return {"context_length": 77}

    client = standin(app)
    assert (await client.model_info()).weight_version == "3"
    assert (await client.server_info())["context_length"] == 77
    assert await standin(FastAPI()).server_info() == {}
    with pytest.raises(EngineError):
        await standin(FastAPI()).model_info()


async def test_transient_errors_are_retried_and_4xx_are_not() -> None:
    calls: list[int] = []
    answers = [503, 429, 200]

    app = FastAPI()

    @app.post("/generate")
    async def flaky() -> JSONResponse:
        code = answers[min(len(calls), len(answers) - 1)]
        calls.append(code)
        return JSONResponse(GENERATED if code == 200 else {"error": {"message": "busy"}}, code)

    [gen] = await standin(app, attempts=3).generate([1, 2], params(1))
    assert calls == [503, 429, 200]
    assert gen.text == "x</search>" and gen.weight_version == "7" and gen.logprobs == [-0.5]

    calls.clear()
    answers[:] = [503]
    with pytest.raises(EngineError) as exhausted:
        await standin(app, attempts=2).generate([1], params(1))
    assert exhausted.value.status_code == 503 and calls == [503, 503]

    calls.clear()
    answers[:] = [422]
    with pytest.raises(EngineError) as refused:
        await standin(app, attempts=5).generate([1], params(1))
    assert refused.value.status_code == 422 and not isinstance(refused.value, ContextExceeded)
    assert calls == [422]


async def test_unreachable_engine_is_retried_then_raised() -> None:
    client = EngineClient(f"http://127.0.0.1:{free_port()}", attempts=2, backoff_base_s=0.001)
    async with client:
        with pytest.raises(httpx.ConnectError):
            await client.generate([1], params(1))
        assert not await client.health()
