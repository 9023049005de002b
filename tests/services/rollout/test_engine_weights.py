"""The CPU engine refuses weights that must not load and keeps serving the old ones:
NaN / inf, incomplete or unexpected tensors, malformed headers (400), a file that links
out of the weights root (403); with no weights root it refuses every update (403)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.rollout.engine.inprocess import EngineThread
from tests import weights_cases
from tests.services.rollout.test_engine_support import ADMIN_HEADERS, engine_settings, generate

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
PROMPT = {"input_ids": [11, 12, 13, 14], "sampling_params": GREEDY}


@pytest.fixture(scope="module")
def folders(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return weights_cases.build(tiny_model_dir, tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path, folders: dict[str, Path]) -> Iterator[str]:
    root = folders["good"].parent
    with EngineThread(engine_settings(tiny_model_dir, weights_root=str(root))) as base:
        yield base


def update(url: str, folder: Path, version: str = "9") -> httpx.Response:
    body = {"model_path": str(folder), "weight_version": version}
    return httpx.post(
        f"{url}/update_weights_from_disk", json=body, headers=ADMIN_HEADERS, timeout=60
    )


@pytest.mark.parametrize("case", weights_cases.REFUSED_400)
def test_bad_weights_are_a_400_and_the_old_ones_keep_serving(
    url: str, folders: dict[str, Path], case: str
) -> None:
    before = generate(url, PROMPT)
    reply = update(url, folders[case])
    assert reply.status_code == 400, reply.text
    assert reply.json()["success"] is False
    assert str(folders[case].parent) not in reply.text  # the weights root is never shown
    after = generate(url, PROMPT)
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]
    assert after["output_ids"] == before["output_ids"]


def test_a_file_linking_out_of_the_root_is_forbidden(url: str, folders: dict[str, Path]) -> None:
    version = httpx.get(f"{url}/model_info").json()["weight_version"]
    reply = update(url, folders["symlinked_file"])
    assert reply.status_code == 403, reply.text
    assert "outside the weights root" in reply.json()["message"]
    assert httpx.get(f"{url}/model_info").json()["weight_version"] == version
    assert update(url, folders["good"], "3").status_code == 200  # the root itself still works


def test_an_engine_without_a_weights_root_refuses_every_update(
    tiny_model_dir: Path, folders: dict[str, Path]
) -> None:
    with EngineThread(engine_settings(tiny_model_dir)) as base:
        reply = update(base, folders["good"])
        assert reply.status_code == 403 and "no weights root" in reply.json()["message"]
        assert httpx.get(f"{base}/model_info").json()["weight_version"] == "0"
