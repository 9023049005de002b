"""The CPU engine bounds a request's work before doing it, and never tokenises on its event
loop; strings that are not valid Unicode and seeds beyond int64 are bad input naming the
field (SGLang's 400), not 500s."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.rollout.engine.engine import Engine
from services.rollout.engine.inprocess import EngineThread
from tests.services.rollout.test_engine_support import engine_settings

CONTEXT = 256
PROMPT_BYTES = CONTEXT * 4  # max_text_bytes_per_token = 4


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[str, Engine]]:
    settings = engine_settings(
        tiny_model_dir,
        context_length=CONTEXT,
        max_samples_per_request=8,
        max_text_bytes_per_token=4.0,
        max_request_text_bytes=4096,
    )
    thread = EngineThread(settings)
    app: Any = thread.server.config.app
    with thread as url:
        yield url, app.state.engine


class CountingTokenizer:
    """The engine's tokenizer, counting (and optionally slowing down) encode calls."""

    def __init__(self, inner: Any, delay_s: float = 0.0) -> None:
        self.inner, self.delay_s, self.calls = inner, delay_s, 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        time.sleep(self.delay_s)  # blocking, as real tokenising is
        return list(self.inner.encode(text, add_special_tokens=add_special_tokens))


@pytest.fixture
def counting(served: tuple[str, Engine]) -> Iterator[CountingTokenizer]:
    engine = served[1]
    original = engine.tokenizer
    engine.tokenizer = CountingTokenizer(original)
    try:
        yield engine.tokenizer
    finally:
        engine.tokenizer = original


def post(url: str, body: Any) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=30)


SURROGATES: list[tuple[str, str]] = [
    ('{"text": "a\\ud800b"}', "text"),
    ('{"text": ["fine", "\\udfff"]}', "text"),
    ('{"input_ids": [1], "rid": "r\\ud800"}', "rid"),
    ('{"input_ids": [1], "sampling_params": {"stop": ["\\ud83d"]}}', "stop"),
    ('{"input_ids": [1], "sampling_params": {"sampling_seed": 18446744073709551616}}', "sampling_seed"),
    ('{"input_ids": [1], "sampling_params": {"sampling_seed": -9223372036854775809}}', "sampling_seed"),
]


@pytest.mark.parametrize(("raw", "field"), SURROGATES)
def test_invalid_strings_and_seeds_are_422_naming_the_field(
    served: tuple[str, Engine], raw: str, field: str
) -> None:
    url = served[0]
    response = httpx.post(
        f"{url}/generate", content=raw, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code in (400, 422), response.text  # 400: SGLang's code for it
    assert field in response.json()["message"]


def test_valid_pairs_and_the_int64_edge_still_work(served: tuple[str, Engine]) -> None:
    url = served[0]
    params = {"max_new_tokens": 1, "sampling_seed": 2**63 - 1, "n": 2, "ignore_eos": True}
    response = post(url, {"text": "emoji \U0001f600", "sampling_params": params})
    assert response.status_code == 200, response.text
    assert [len(o["output_ids"]) for o in response.json()] == [1, 1]


def test_samples_per_request_are_capped(served: tuple[str, Engine]) -> None:
    url = served[0]
    over = post(url, {"input_ids": [[1], [2], [3]], "sampling_params": {"n": 3}})
    assert over.status_code == 413 and "max_samples_per_request" in over.json()["message"]
    per_prompt = [{"n": 4, "max_new_tokens": 1}, {"n": 5, "max_new_tokens": 1}]
    assert post(url, {"input_ids": [[1], [2]], "sampling_params": per_prompt}).status_code == 413
    texts = post(url, {"text": ["a"] * 9, "sampling_params": {"max_new_tokens": 1}})
    assert texts.status_code == 413
    at_cap = post(url, {"input_ids": [[1], [2]], "sampling_params": {"n": 4, "max_new_tokens": 1}})
    assert at_cap.status_code == 200 and len(at_cap.json()) == 8


def test_oversized_texts_are_refused_before_tokenising(
    served: tuple[str, Engine], counting: CountingTokenizer
) -> None:
    url = served[0]
    one = post(url, {"text": "x" * (PROMPT_BYTES + 1)})
    assert one.status_code == 413 and "not tokenised" in one.json()["message"]
    multibyte = post(url, {"text": ["ok", "\u00e9" * (PROMPT_BYTES // 2 + 1)]})  # 2 bytes each
    assert multibyte.status_code == 413 and "text[1]" in multibyte.json()["message"]
    together = post(url, {"text": ["y" * 1000] * 5})  # 5000 bytes > 4096 per request
    assert together.status_code == 413 and "max_request_text_bytes" in together.json()["message"]
    assert counting.calls == 0
    fits = post(url, {"text": "a short prompt", "sampling_params": {"max_new_tokens": 1}})
    assert fits.status_code == 200 and counting.calls == 1


def test_tokenising_stops_at_the_first_text_over_the_context(
    served: tuple[str, Engine], counting: CountingTokenizer
) -> None:
    """Texts within the byte caps but each over the context: the first one is a 400, the
    other five are never tokenised."""
    texts = [f"{i} " + "x " * 300 for i in range(6)]  # 600 bytes, 600 tokens: each fits 1024
    too_long = post(url=served[0], body={"text": texts, "sampling_params": {"max_new_tokens": 1}})
    assert too_long.status_code == 400 and "context length" in too_long.json()["error"]["message"]
    assert counting.calls == 1  # not 6


async def test_tokenising_does_not_block_the_event_loop(
    served: tuple[str, Engine], counting: CountingTokenizer
) -> None:
    url = served[0]
    counting.delay_s = 1.5
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        body = {"text": "slow to tokenise", "sampling_params": {"max_new_tokens": 1}}
        slow = asyncio.create_task(client.post("/generate", json=body))
        while counting.calls == 0:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        health = await client.get("/health")
        waited = time.monotonic() - started
        assert health.status_code == 200 and waited < 0.75, waited
        assert not slow.done()
        assert (await slow).status_code == 200
