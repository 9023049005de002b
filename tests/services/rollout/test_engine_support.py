"""Helpers shared by the CPU-engine and engine-client tests (this module holds no tests)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import load_file, save_file

from services.rollout.engine.settings import EngineSettings

ADMIN = "engine-admin-token"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


def engine_settings(model_dir: Path, **overrides: Any) -> EngineSettings:
    values: dict[str, Any] = {
        "port": 0,
        "model_path": str(model_dir),
        "admin_token": ADMIN,
        "max_wait_ms": 20.0,
        "threads": 1,
        "drain_timeout_s": 2.0,
        **overrides,
    }
    return EngineSettings(**values)


def perturbed_copy(src: Path, dst: Path, seed: int, scale: float = 0.5) -> Path:
    """An HF folder like ``src`` whose weights carry Gaussian noise (a "new policy")."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for file in dst.glob("*.safetensors"):
        state = load_file(str(file))
        noisy = {
            name: (t + scale * t.std().nan_to_num(0.0) * torch.randn(t.shape, generator=generator))
            .to(t.dtype)
            .contiguous()
            for name, t in state.items()
        }
        save_file(noisy, str(file), metadata={"format": "pt"})
    return dst


def teacher_forced(model: Any, ids: list[int], temperature: float = 1.0) -> list[float]:
    """log p(ids[t] | ids[:t]) for t = 1..len-1 from one plain forward pass, of the
    distribution at ``temperature`` (log_softmax(logits / T))."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # (T, V)
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    targets = torch.tensor(ids[1:])
    return logprobs[:-1].gather(-1, targets[:, None])[:, 0].tolist()


def generate(url: str, body: dict[str, Any], timeout: float = 60.0) -> Any:
    response = httpx.post(f"{url}/generate", json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()


def sampled(max_new_tokens: int, seed: int, **extra: Any) -> dict[str, Any]:
    """Sampling parameters of a reproducible temperature-1 sample."""
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "sampling_seed": seed,
        "ignore_eos": True,
        **extra,
    }


def first_new_piece(tokenizer: Any, ids: list[int], skip: int = 2) -> tuple[int, str]:
    """An output position k >= skip whose token's text is non-empty and new in the text
    before it: a stop string that must first match exactly there."""
    special = set(tokenizer.all_special_ids)
    for k in range(skip, len(ids)):
        piece = tokenizer.decode([ids[k]])
        if ids[k] not in special and piece.strip() and piece not in tokenizer.decode(ids[:k]):
            return k, piece
    raise AssertionError("no usable stop piece in the sample")
