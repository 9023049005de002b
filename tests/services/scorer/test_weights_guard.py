"""The scorer refuses weights that must not load and keeps scoring with the old ones:
NaN / inf, missing or unexpected tensors, malformed headers (400), a file that links out
of the weights root (403); with no weights root it refuses every update (403)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.scorer.model import LoadedModel
from tests import weights_cases

from .conftest import AppClient

ITEM = {"items": [{"context": "Where was Bothi born?", "answers": ["Dostania"]}]}
AUTH = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def folders(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return weights_cases.build(tiny_model_dir, tmp_path_factory.mktemp("weights"))


async def test_bad_weights_are_refused_and_the_old_ones_keep_scoring(
    app_client: AppClient, folders: dict[str, Path]
) -> None:
    root = str(folders["good"].parent)
    async with app_client(admin_token="s3cret", weights_root=root) as client:
        scored = await client.post("/v1/score", json=ITEM)
        assert scored.status_code == 200, scored.text
        before = scored.json()
        for case in (*weights_cases.REFUSED_400, *weights_cases.REFUSED_403):
            body = {"model_path": str(folders[case]), "weight_version": "9"}
            reply = await client.post("/update_weights_from_disk", json=body, headers=AUTH)
            expected = 400 if case in weights_cases.REFUSED_400 else 403
            assert reply.status_code == expected, (case, reply.text)
            info = (await client.get("/model_info")).json()
            assert info["weight_version"] == "0", case
        after = (await client.post("/v1/score", json=ITEM)).json()
        assert after == before  # the same weights, the same scores
        good = {"model_path": str(folders["good"]), "weight_version": "1"}
        reply = await client.post("/update_weights_from_disk", json=good, headers=AUTH)
        assert reply.status_code == 200 and reply.json()["success"] is True, reply.text


async def test_an_update_copies_the_weights_into_a_new_model(
    app_client: AppClient, folders: dict[str, Path], loaded: LoadedModel, tmp_path: Path
) -> None:
    """The checked tensors are what the scorer then serves; the shared model is untouched."""
    from safetensors.torch import load_file, save_file

    root = tmp_path / "root"
    state = load_file(str(folders["good"] / "model.safetensors"))
    doubled = {k: v * 2 if v.is_floating_point() else v for k, v in state.items()}
    (root / "v2").mkdir(parents=True)
    save_file(doubled, str(root / "v2" / "model.safetensors"))
    original = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    async with app_client(weights_root=str(root)) as client:
        body = {"model_path": str(root / "v2"), "weight_version": "2"}
        reply = await client.post("/update_weights_from_disk", json=body)
        assert reply.status_code == 200, reply.text
        served = client.app.state.scorer.current.model.state_dict()  # type: ignore[attr-defined]
    for name, tensor in doubled.items():
        assert torch.equal(served[name], tensor), name
    for name in served.keys() - doubled.keys():  # a tied weight follows the one it shares
        assert torch.equal(served[name], doubled["model.embed_tokens.weight"]), name
    assert all(torch.equal(loaded.model.state_dict()[k], v) for k, v in original.items())


async def test_a_scorer_without_a_weights_root_refuses_every_update(
    app_client: AppClient, folders: dict[str, Path]
) -> None:
    async with app_client() as client:
        body = {"model_path": str(folders["good"]), "weight_version": "1"}
        reply = await client.post("/update_weights_from_disk", json=body)
        assert reply.status_code == 403 and "no weights root" in reply.json()["message"]
        assert (await client.get("/model_info")).json()["weight_version"] == "0"
