"""The CPU engine refuses what SGLang refuses, with SGLang's codes and bodies (issue 14,
item 2): an unknown sampling_params key is 400 ``unknown field `seed`, ...``, a wrong
admin token 401 (not 403), a malformed body 400 (not 422). Real HTTP, the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mempo.api.engine import SGLANG_SAMPLING_FIELDS
from services.rollout.engine.contract import unknown_field_message
from services.rollout.engine.inprocess import EngineThread
from tests.services.rollout.test_engine_support import ADMIN_HEADERS, engine_settings

GREEDY = {"max_new_tokens": 2, "temperature": 0.0}


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("strict-weights")
    with EngineThread(engine_settings(tiny_model_dir, weights_root=str(root))) as base:
        yield base


def post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("key", ["seed", "temprature", "max_tokens", "random_seed"])
def test_unknown_sampling_keys_are_sglangs_400(url: str, key: str) -> None:
    reply = post(url, "/generate", {"input_ids": [5, 6], "sampling_params": {**GREEDY, key: 1}})
    assert reply.status_code == 400, reply.text
    assert reply.json() == {"error": unknown_field_message(key)}
    assert reply.json()["error"].startswith(f"unknown field `{key}`, expected one of ")
    batch = {"input_ids": [[5], [6]], "sampling_params": [GREEDY, {**GREEDY, key: None}]}
    assert post(url, "/generate", batch).status_code == 400  # any prompt's, even null


def test_every_sglang_key_at_a_neutral_value_is_accepted(url: str) -> None:
    neutral = {"min_p": 0.0, "frequency_penalty": 0, "presence_penalty": 0.0,
               "repetition_penalty": 1.0, "min_new_tokens": 0, "logit_bias": {},
               "spaces_between_special_tokens": True, "stream_interval": 4, "regex": None,
               "stop_regex": [], "choice": [], "beam_width": None, "custom_params": None}  # fmt: skip
    assert set(neutral) <= set(SGLANG_SAMPLING_FIELDS)
    reply = post(url, "/generate", {"input_ids": [5, 6], "sampling_params": {**GREEDY, **neutral}})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    ("key", "value"),
    [("min_p", 0.1), ("repetition_penalty", 1.3), ("regex", "a+"), ("logit_bias", {"5": 2.0})],
)
def test_sglang_keys_the_cpu_engine_cannot_honour_are_400(url: str, key: str, value: Any) -> None:
    reply = post(url, "/generate", {"input_ids": [5], "sampling_params": {**GREEDY, key: value}})
    assert reply.status_code == 400, reply.text
    assert f"sampling_params.{key}: not supported by the CPU engine" in reply.json()["message"]


def test_a_wrong_or_missing_admin_token_is_401(url: str) -> None:
    for headers in ({"Authorization": "Bearer wrong"}, {}, {"Authorization": "Basic x"}):
        reply = post(url, "/pause_generation", {"mode": "in_place"}, headers)
        assert reply.status_code == 401, reply.text
        assert reply.json()["error"] == "Unauthorized"
        assert reply.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/ready").status_code == 200  # nothing was paused
    assert post(url, "/abort_request", {"rid": "x"}, ADMIN_HEADERS).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", b"{not json", "JSON decode error"),
        ("/generate", b'{"input_ids": ["x"]}', "input_ids"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', "top_p"),
        ("/generate", b'{"text": "a", "input_ids": [1]}', "text / input_ids"),
        ("/update_weights_from_disk", b'{"model_path": ""}', "model_path"),
        ("/pause_generation", b'{"mode": "sideways"}', "mode"),
    ],
)
def test_malformed_bodies_are_400_with_sglangs_shape(
    url: str, path: str, body: bytes, field: str
) -> None:
    headers = {**ADMIN_HEADERS, "content-type": "application/json"}
    reply = httpx.post(f"{url}{path}", content=body, headers=headers, timeout=60)
    assert reply.status_code == 400, reply.text
    answer = reply.json()
    assert answer["object"] == "error" and answer["code"] == 400
    assert field in answer["message"]
