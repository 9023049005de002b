"""The CPU engine's /generate against the tiny model, over real HTTP: SGLang's shapes,
determinism, exact log-probs, stop rules, batching, context limits, bad input."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from services.rollout.engine.inprocess import EngineThread
from tests.services.rollout.test_engine_support import (
    engine_settings,
    first_new_piece,
    generate,
    sampled,
    teacher_forced,
)

CONTEXT = 256


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path) -> Iterator[str]:
    settings = engine_settings(
        tiny_model_dir, context_length=CONTEXT, max_batch_size=16, max_body_bytes=1_000_000
    )
    with EngineThread(settings) as base:
        yield base


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def prompt_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def check_logprob_triples(entries: list[Any], ids: list[int], first_null: bool) -> None:
    assert [e[1] for e in entries] == ids
    for j, (logprob, token, text) in enumerate(entries):
        assert isinstance(token, int) and text is None
        if first_null and j == 0:
            assert logprob is None
        else:
            assert isinstance(logprob, float) and logprob <= 0.0


def test_single_response_has_sglang_shape(url: str, tokenizer: Any) -> None:
    prompt = prompt_of(tokenizer, "Who founded the city of Varo?")
    out = generate(
        url, {"input_ids": prompt, "sampling_params": sampled(12, 1), "return_logprob": True}
    )
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "weight_version",
        "e2e_latency",
        "output_token_logprobs",
        "input_token_logprobs",
    } <= set(meta)
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(prompt)
    assert meta["completion_tokens"] == len(out["output_ids"]) == 12
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "0"
    assert re.fullmatch(r"[0-9a-f]{32}", meta["id"])
    check_logprob_triples(meta["output_token_logprobs"], out["output_ids"], first_null=False)
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: output only
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)

    plain = generate(url, {"input_ids": prompt, "sampling_params": sampled(3, 1), "rid": "r1"})
    assert "output_token_logprobs" not in plain["meta_info"]
    assert plain["meta_info"]["id"] == "r1"


def test_batch_and_n_answer_lists_prompt_major(url: str, tokenizer: Any) -> None:
    prompts = [
        prompt_of(tokenizer, "alpha beta"),
        prompt_of(tokenizer, "a longer second prompt here"),
    ]
    body = {"input_ids": prompts, "rid": "b", "sampling_params": {**sampled(4, 3), "n": 3}}
    out = generate(url, body)
    assert isinstance(out, list) and len(out) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(prompts[0])] * 3 + [
        len(prompts[1])
    ] * 3
    assert [o["meta_info"]["id"] for o in out] == [f"b_{i}_{j}" for i in range(2) for j in range(3)]
    assert len({tuple(o["output_ids"]) for o in out[:3]}) == 3  # the n samples differ

    texts = generate(url, {"text": ["alpha beta", "gamma"], "sampling_params": sampled(2, 0)})
    assert [o["meta_info"]["prompt_tokens"] for o in texts] == [
        len(prompts[0]),
        len(prompt_of(tokenizer, "gamma")),
    ]
    single_n = generate(
        url, {"input_ids": prompts[0], "sampling_params": {**sampled(2, 0), "n": 2}}
    )
    assert isinstance(single_n, list) and len(single_n) == 2
    per_prompt = generate(
        url, {"input_ids": prompts, "sampling_params": [sampled(1, 0), sampled(3, 0)]}
    )
    assert [o["meta_info"]["completion_tokens"] for o in per_prompt] == [1, 3]


def test_greedy_and_seeded_sampling_are_deterministic(url: str, tokenizer: Any) -> None:
    prompt = prompt_of(tokenizer, "Where was Mira Dole born?")
    greedy = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    body = {"input_ids": prompt, "sampling_params": greedy, "return_logprob": True}
    first, second = generate(url, body), generate(url, body)
    assert first["output_ids"] == second["output_ids"]
    assert (
        first["meta_info"]["output_token_logprobs"] == second["meta_info"]["output_token_logprobs"]
    )

    seeded = [
        generate(url, {"input_ids": prompt, "sampling_params": sampled(16, s)}) for s in (7, 7, 8)
    ]
    assert seeded[0]["output_ids"] == seeded[1]["output_ids"] != seeded[2]["output_ids"]


async def test_logprobs_equal_a_teacher_forced_forward(
    url: str, tokenizer: Any, hf_model: Any
) -> None:
    prompts = [
        prompt_of(tokenizer, t)
        for t in ("x", "Who wrote the Book of Tarn?", "one two three four five six seven")
    ]
    async with httpx.AsyncClient(timeout=60) as client:  # concurrent: padded rows of one batch
        replies = await asyncio.gather(
            *(
                client.post(
                    f"{url}/generate",
                    json={
                        "input_ids": p,
                        "sampling_params": sampled(20, i),
                        "return_logprob": True,
                        "logprob_start_len": 0,
                    },
                )
                for i, p in enumerate(prompts)
            )
        )
    for prompt, reply in zip(prompts, replies, strict=True):
        out = reply.json()
        meta = out["meta_info"]
        reference = teacher_forced(hf_model, prompt + out["output_ids"])
        got_out = [e[0] for e in meta["output_token_logprobs"]]
        got_in = [e[0] for e in meta["input_token_logprobs"]]
        check_logprob_triples(meta["input_token_logprobs"], prompt, first_null=True)
        assert len(got_in) == len(prompt) and len(got_out) == 20
        assert torch.allclose(
            torch.tensor(got_out), torch.tensor(reference[len(prompt) - 1 :]), atol=1e-4
        )
        assert torch.allclose(
            torch.tensor(got_in[1:]), torch.tensor(reference[: len(prompt) - 1]), atol=1e-4
        )


def test_prefill_only_scoring_matches_sglang_recipe(
    url: str, tokenizer: Any, hf_model: Any
) -> None:
    context, answer = prompt_of(tokenizer, "The capital is"), prompt_of(tokenizer, " Varo")
    body = {
        "input_ids": context + answer,
        "return_logprob": True,
        "logprob_start_len": len(context) - 1,
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
    }
    out = generate(url, body)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 0,
    }
    values = [e[0] for e in out["meta_info"]["input_token_logprobs"]][1:]
    reference = teacher_forced(hf_model, context + answer)[len(context) - 1 :]
    assert len(values) == len(answer)
    assert torch.allclose(torch.tensor(values), torch.tensor(reference), atol=1e-4)
    at_end = generate(url, {**body, "logprob_start_len": len(context + answer)})
    assert at_end["meta_info"]["input_token_logprobs"] == []


def test_stop_string_is_trimmed_and_reported(url: str, tokenizer: Any) -> None:
    prompt = prompt_of(tokenizer, "<mem> the query </mem> <search>")
    full = generate(url, {"input_ids": prompt, "sampling_params": sampled(40, 11)})
    k, piece = first_new_piece(tokenizer, full["output_ids"])
    out = generate(
        url, {"input_ids": prompt, "sampling_params": sampled(40, 11, stop=["</never>", piece])}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": piece}
    assert out["output_ids"] == full["output_ids"][: k + 1]  # the ids keep the stop token
    text = tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert out["text"] == text[: text.find(piece)] and not out["text"].endswith(piece)
    kept = generate(
        url,
        {"input_ids": prompt, "sampling_params": sampled(40, 11, stop=piece, no_stop_trim=True)},
    )
    assert kept["text"] == text


def test_stop_token_ids_and_length(url: str, tokenizer: Any) -> None:
    prompt = prompt_of(tokenizer, "Name the river.")
    full = generate(url, {"input_ids": prompt, "sampling_params": sampled(30, 5)})
    k = next(k for k in range(1, 30) if full["output_ids"][k] not in full["output_ids"][:k])
    stop_id = full["output_ids"][k]
    out = generate(
        url, {"input_ids": prompt, "sampling_params": sampled(30, 5, stop_token_ids=[stop_id])}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == full["output_ids"][: k + 1]
    assert out["text"] == tokenizer.decode(out["output_ids"][:-1], skip_special_tokens=True)
    # the last allowed token is the stop token: length wins, as in SGLang's check order
    last = generate(
        url, {"input_ids": prompt, "sampling_params": sampled(k + 1, 5, stop_token_ids=[stop_id])}
    )
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": k + 1}
    assert last["output_ids"] == out["output_ids"]


def decode_steps_with_company(metrics_text: str) -> float:
    """Decode steps that ran more than one row (histogram count minus its le=1 bucket)."""

    def value(name: str) -> float:
        match = re.search(rf"^{re.escape(name)} (\S+)$", metrics_text, re.M)
        return float(match.group(1)) if match else 0.0

    return value("mempo_engine_decode_batch_rows_count") - value(
        'mempo_engine_decode_batch_rows_bucket{le="1.0"}'
    )


async def test_concurrent_requests_share_batches(url: str, tokenizer: Any) -> None:
    prompts = [prompt_of(tokenizer, f"question number {i} about the world") for i in range(8)]
    alone = [
        generate(url, {"input_ids": p, "sampling_params": sampled(24, i)})
        for i, p in enumerate(prompts)
    ]
    before = httpx.get(f"{url}/metrics").text
    async with httpx.AsyncClient(timeout=60) as client:
        replies = await asyncio.gather(
            *(
                client.post(
                    f"{url}/generate", json={"input_ids": p, "sampling_params": sampled(24, i)}
                )
                for i, p in enumerate(prompts)
            )
        )
    after = httpx.get(f"{url}/metrics").text
    shared = decode_steps_with_company(after) - decode_steps_with_company(before)
    assert shared >= 20, f"only {shared} decode steps ran several rows"
    # batching changes nothing about the samples
    assert [r.json()["output_ids"] for r in replies] == [a["output_ids"] for a in alone]
    state = httpx.get(f"{url}/server_info").json()["internal_states"][0]
    assert state["max_decode_batch"] >= 4


def test_prompt_beyond_the_context_is_refused_like_sglang(url: str) -> None:
    fits = httpx.post(
        f"{url}/generate",
        json={"input_ids": [5] * (CONTEXT - 10), "sampling_params": {"max_new_tokens": 10}},
    )
    assert fits.status_code == 200
    over = httpx.post(
        f"{url}/generate",
        json={"input_ids": [5] * (CONTEXT - 10), "sampling_params": {"max_new_tokens": 11}},
    )
    assert over.status_code == 400
    assert "maximum context length of 256 tokens" in over.json()["error"]["message"]
    long = httpx.post(f"{url}/generate", json={"input_ids": [5] * CONTEXT})
    assert long.status_code == 400
    assert "longer than the model's context length" in long.json()["error"]["message"]


BAD_BODIES: list[tuple[Any, str]] = [
    ({}, "text / input_ids"),
    ({"text": "a", "input_ids": [1]}, "text / input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": ["x"]}, "input_ids"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]"),
    ({"input_ids": [99999]}, "vocabulary"),
    ({"input_ids": [-1]}, "vocabulary"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "n"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
    ({"input_ids": [1], "sampling_params": {"stop": 5}}, "stop"),
    ([1, 2, 3], "body"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"text": ""}, "text"),
    ({"text": []}, "text"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_bad_bodies_are_4xx_naming_the_field(url: str, body: Any, field: str) -> None:
    response = httpx.post(f"{url}/generate", json=body)
    assert 400 <= response.status_code < 500, response.text
    assert field in response.json()["message"]


def test_unparseable_and_oversized_bodies(url: str) -> None:
    broken = httpx.post(
        f"{url}/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400  # SGLang's code for a body it cannot parse
    huge = httpx.post(f"{url}/generate", content=b"[" + b"1," * 600_000 + b"1]")
    assert huge.status_code == 413
    assert httpx.get(f"{url}/no_such_route").status_code == 404


async def test_a_late_short_request_does_not_wait_for_a_long_one(url: str) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        body = {"input_ids": [5, 6, 7], "sampling_params": sampled(CONTEXT - 4, 0)}
        long = asyncio.create_task(client.post(f"{url}/generate", json=body))
        await asyncio.sleep(0.1)
        short = await client.post(
            f"{url}/generate", json={"input_ids": [9] * 20, "sampling_params": sampled(3, 1)}
        )
        assert short.json()["meta_info"]["completion_tokens"] == 3
        assert not long.done()  # the short one joined the running batch and left it first
        assert (await long).json()["meta_info"]["completion_tokens"] == CONTEXT - 4


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.floats(-2, 3) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = ["text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len"]
SAMPLING = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "n",
    "sampling_seed",
]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    body=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4),
    params=st.dictionaries(st.sampled_from(SAMPLING), JSON, max_size=4),
    ids=st.lists(st.integers(-2, 2100), min_size=0, max_size=6),
)
def test_arbitrary_bodies_never_cause_a_500(
    url: str, body: dict[str, Any], params: dict[str, Any], ids: list[int]
) -> None:
    body = {"input_ids": ids, **body, "sampling_params": {"max_new_tokens": 4, **params}}
    if isinstance(body["sampling_params"].get("n"), int):
        body["sampling_params"]["n"] = min(body["sampling_params"]["n"], 4)
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code in (200, 400, 422), response.text
