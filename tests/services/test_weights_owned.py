"""Served weights do not alias the files they were loaded from: the CPU engine and the
scorer, as real processes, keep serving the same outputs when the loaded
``model.safetensors`` is rewritten in place with NaN bytes (no update call), and stay
alive (no SIGBUS) serving the same outputs when it is truncated to 0 bytes. Both load
paths: the model a service starts with (transformers' ``from_pretrained``) and a folder
sent to ``/update_weights_from_disk`` (mempo.weights.load_checked)."""

from __future__ import annotations

import math
import os
import secrets
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from mempo.procs import free_port, wait_ready
from tests.services.rollout.test_engine_support import perturbed_copy

pytestmark = pytest.mark.e2e
TOKEN = secrets.token_hex(16)
PROMPT = {
    "input_ids": [11, 12, 13, 14, 15],
    "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
    "return_logprob": True,
}
ITEMS = {
    "items": [
        {"context": "Where was Bothi born?", "answers": ["Dostania", "a town by the sea"]},
        {"context": "Bothi was born in", "answers": ["Dostania"]},
    ]
}
SERVICES = {  # the CLI arguments and the admin token's variable of each service
    "engine": (["rollout", "engine"], "MEMPO_ENGINE_ADMIN_TOKEN"),
    "scorer": (["scorer", "serve", "--device", "cpu"], "MEMPO_SCORER_ADMIN_TOKEN"),
}


@contextmanager
def serving(service: str, model: Path, root: Path, log: Path) -> Iterator[tuple[str, Any]]:
    """The service as a process started from ``model``; its URL and the process. On the
    way out it must still be alive and stop cleanly (a SIGBUS ends it with -7)."""
    args, token_var = SERVICES[service]
    port = free_port()
    env = {**os.environ, token_var: TOKEN, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "mempo_cli", *args, "--port", str(port)]
    argv += ["--model-path", str(model), "--weights-root", str(root)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=120, proc=proc)
        yield url, proc
        assert proc.poll() is None, f"exit {proc.returncode}: {log.read_text()[-2000:]}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode in (0, -signal.SIGTERM), log.read_text()[-2000:]


def outputs(service: str, url: str) -> Any:
    """What the service serves for a fixed request (greedy tokens and their logprobs,
    or item scores): equal before and after only if the weights are."""
    if service == "engine":
        reply = httpx.post(f"{url}/generate", json=PROMPT, timeout=60)
        assert reply.status_code == 200, reply.text
        meta = reply.json()["meta_info"]
        return reply.json()["output_ids"], meta["output_token_logprobs"]
    reply = httpx.post(f"{url}/v1/score", json=ITEMS, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["scores"]


def numbers(value: Any) -> Iterator[float]:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int | float):
        yield float(value)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from numbers(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from numbers(item)


def poison_in_place(file: Path) -> None:
    """Overwrite every data byte of a safetensors file, in place (same inode, header kept),
    with 0xFF: a NaN in every float32."""
    inode = file.stat().st_ino
    with file.open("r+b") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        size = file.stat().st_size - 8 - length
        handle.seek(8 + length)
        handle.write(b"\xff" * size)
        handle.flush()
        os.fsync(handle.fileno())
    assert file.stat().st_ino == inode


Attack = Callable[[Path], None]
ATTACKS: dict[str, Attack] = {
    "rewritten_with_nan": poison_in_place,
    "truncated_to_0": lambda file: os.truncate(file, 0),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("path", ["start", "update"])
@pytest.mark.parametrize("service", sorted(SERVICES))
def test_served_weights_survive_their_file_being_rewritten_or_truncated(
    service: str, path: str, attack: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    root = tmp_path / "weights"
    root.mkdir()
    shutil.copytree(tiny_model_dir, root / "v0")  # never the shared fixture's files
    with serving(service, root / "v0", root, tmp_path / f"{service}.log") as (url, proc):
        loaded = root / "v0"
        if path == "update":
            loaded = perturbed_copy(tiny_model_dir, root / "v1", seed=3)
            body = {"model_path": str(loaded), "weight_version": "1"}
            headers = {"Authorization": f"Bearer {TOKEN}"}
            reply = httpx.post(
                f"{url}/update_weights_from_disk", json=body, headers=headers, timeout=60
            )
            assert reply.status_code == 200 and reply.json()["success"] is True, reply.text
        before = outputs(service, url)
        assert all(math.isfinite(x) for x in numbers(before)), before
        ATTACKS[attack](loaded / "model.safetensors")
        after = outputs(service, url)
        assert proc.poll() is None
        assert after == before  # the same weights: nothing served came from the file
        assert outputs(service, url) == before
