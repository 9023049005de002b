"""Every request body the engine client can build, against SGLang's own contract at the
pinned release (issue 14, item 5), read out of the sglang wheel (tests/contract/
sglang_wheel.py): /generate with each sampling option the worker uses passes
``generate_contract_error``; update_weights_from_disk, the weight broadcast routes
(init / update from distributed / destroy), pause / continue generation and abort pass
their routes' request structs (as FastAPI validates them) with no key SGLang
would silently drop; our sampling names and the CPU engine's unknown-key message are
SGLang's; the GPU image runs exactly that release. An SGLang upgrade or a client change
that breaks the contract fails here.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mempo.agent_format import DEFAULT_TAGS
from mempo.api.engine import CPU_ENGINE_NEUTRAL, SGLANG_SAMPLING_FIELDS, SGLANG_VERSION
from mempo.api.engine import SamplingParams as OurSamplingParams
from mempo.clients.engine import EngineClient
from services.rollout.engine.contract import unknown_field_message
from services.rollout.episode import EpisodeConfig
from tests.contract.sglang_wheel import ROOT, Contract, load_contract

ADMIN_ROUTES = ("/update_weights_from_disk", "/pause_generation", "/continue_generation",
                "/abort_request", "/flush_cache", "/init_weights_update_group",
                "/update_weights_from_distributed", "/destroy_weights_update_group")  # fmt: skip
WEIGHT_ROUTES = ("/update_weights_from_disk", "/init_weights_update_group",
                 "/update_weights_from_distributed", "/destroy_weights_update_group")  # fmt: skip


@pytest.fixture(scope="module")
def contract() -> Contract:
    return load_contract()


def generated(rid: str) -> dict[str, Any]:
    meta = {"id": rid, "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 2,
            "weight_version": "1", "output_token_logprobs": [[-0.5, 3, None]],
            "input_token_logprobs": [[None, 1, None], [-1.0, 2, None]]}  # fmt: skip
    return {"text": "x", "output_ids": [3], "meta_info": meta}


def answer(request: httpx.Request, sent: list[tuple[str, Any]]) -> httpx.Response:
    """What an SGLang server answers; the first /generate of rid "flaky" is a 503."""
    path = request.url.path
    body: Any = json.loads(request.content) if request.content else None
    sent.append((path, body))
    if path == "/generate":
        if body.get("rid") == "flaky":
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, json=generated(body.get("rid") or "x"))
    if path in WEIGHT_ROUTES:
        return httpx.Response(200, json={"success": True, "message": "ok"})
    if path in ("/pause_generation", "/continue_generation"):
        return httpx.Response(200, json={"message": "ok", "status": "ok"})
    return httpx.Response(200, text="")


def episode_params() -> list[dict[str, Any]]:
    """The worker's sampling_params for the settings it has (services/rollout/worker.py)."""
    configs = [
        EpisodeConfig(),
        EpisodeConfig(temperature=0.0, max_new_tokens=64),
        EpisodeConfig(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=512),
        EpisodeConfig(tags=DEFAULT_TAGS, top_k=1),
    ]
    return [c.sampling_params(eos) for c in configs for eos in ([], [2], [2, 7])]


@pytest.fixture(scope="module")
def bodies() -> list[tuple[str, Any]]:
    """(path, JSON body) of every call the client makes, built by the client itself."""
    sent: list[tuple[str, Any]] = []
    asyncio.run(make_every_call(sent))
    return sent


async def make_every_call(sent: list[tuple[str, Any]]) -> None:
    transport = httpx.MockTransport(lambda request: answer(request, sent))
    async with httpx.AsyncClient(transport=transport) as http:
        client = EngineClient("http://engine", admin_token="t", client=http, backoff_base_s=0.0)
        for params in episode_params():
            await client.generate([1, 2], params, True, "traj-0")
        await client.generate([1, 2], episode_params()[0], True, "flaky")  # + its retry
        await client.generate([1, 2], {**episode_params()[0], "sampling_seed": 3}, False)
        await client.generate([1, 2], {"max_new_tokens": 0, "temperature": 0.0}, True, None, 1)
        for abort_all in (False, True):
            await client.update_weights_from_disk("/weights/v3", "3", abort_all)
        for mode in ("abort", "retract", "in_place"):
            await client.pause_generation(mode)
        await client.continue_generation()
        await client.abort_request("traj-0")
        await client.abort_request(abort_all=True)
        await client.flush_cache()
        for backend in ("gloo", "nccl"):
            await client.init_weights_update_group("learner", 29500, 1, 3, backend=backend)
        names, dtypes, shapes = ["a.weight", "b.bias"], ["bfloat16", "float32"], [[2, 3], [3]]
        await client.update_weights_from_distributed(names, dtypes, shapes)
        await client.update_weights_from_distributed(names, dtypes, shapes, "7", load_format=None)
        await client.destroy_weights_update_group()


def test_the_wheel_is_the_pinned_release(contract: Contract) -> None:
    assert contract.version == SGLANG_VERSION


def test_our_sampling_names_are_sglangs(contract: Contract) -> None:
    assert contract.sampling_fields == SGLANG_SAMPLING_FIELDS
    assert set(CPU_ENGINE_NEUTRAL) <= set(contract.sampling_fields)
    assert set(OurSamplingParams.model_fields) <= set(contract.sampling_fields)


def test_every_generate_body_passes_sglangs_contract(
    contract: Contract, bodies: list[tuple[str, Any]]
) -> None:
    generate = [body for path, body in bodies if path == "/generate"]
    assert len(generate) == len(episode_params()) + 4  # the retry included
    assert any(b.get("rid") == "flaky-r1" for b in generate)
    for body in generate:
        assert contract.generate_contract_error(body) is None, body
        assert contract.routes["/generate"].auth == "NORMAL"


@pytest.mark.parametrize("key", ["seed", "temprature", "max_tokens"])
def test_the_cpu_engine_words_unknown_keys_as_sglang(contract: Contract, key: str) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"temperature": 1.0, key: 1}}
    assert contract.generate_contract_error(body) == unknown_field_message(key)


def test_every_admin_body_passes_its_sglang_route(
    contract: Contract, bodies: list[tuple[str, Any]]
) -> None:
    admin = [(path, body) for path, body in bodies if path != "/generate"]
    assert {path for path, _ in admin} == set(ADMIN_ROUTES)
    for path, body in admin:
        route = contract.routes[path]
        assert route.auth == "ADMIN_OPTIONAL", route  # the admin token opens it
        assert contract.body_error(path, body) is None, (path, body)
        if route.body is None:
            assert not body, (path, body)  # SGLang reads no body there
            continue
        fields = contract.fields(route.body)
        assert set(body) <= fields, f"{path}: SGLang would ignore {set(body) - fields}"


def test_the_checks_catch_a_broken_body(contract: Contract) -> None:
    assert contract.generate_contract_error({"input_ids": [1], "sampling_params": {"seed": 1}})
    assert contract.generate_contract_error({"input_ids": "1"})
    assert contract.body_error("/update_weights_from_disk", {"weight_version": "3"})
    assert contract.body_error("/pause_generation", {"mode": "sideways"})
    fields = contract.fields("UpdateWeightFromDiskReqInput")
    assert "weight_verison" not in fields and {"model_path", "weight_version"} <= fields


def test_the_gpu_image_runs_the_pinned_release() -> None:
    tag = f"lmsysorg/sglang:v{SGLANG_VERSION}"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["rollout"]["build"]["args"]["BASE_IMAGE"] == tag
    # the image build refuses a base with another sglang release
    assert "the client is audited against" in (ROOT / "docker/install.sh").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "sglang:latest" not in dockerfile + Path(ROOT / "docker-compose.yml").read_text()
