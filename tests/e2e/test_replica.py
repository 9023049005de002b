"""One rollout replica as the compose file runs it (services/rollout/entrypoint.sh with
ENGINE=cpu), on loopback (issue 13, item 7):

- its engine listens on 127.0.0.1 only, with a key the entrypoint made and that never
  leaves the replica (not in the registry, not in the worker's pages, not on a command line);
- the worker registers its own URL in Redis, and the learner's publisher updates the
  engine through it with the worker's token (the engine refuses that token itself).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis
import yaml

from mempo.keys import Keys
from mempo.procs import RedisServer, free_port, wait_ready
from mempo.queue import RedisQueue, connect
from services.learner.publish import PublishReport, WeightPublisher

REPO = Path(__file__).resolve().parents[2]
WORKER_TOKEN = secrets.token_hex(16)


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp*) with a LISTEN socket on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) == port and fields[3] == "0A":
                found.add(address)
    return found


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


class Exporter:
    def __init__(self, source: Path) -> None:
        self.source = source

    def export_hf(self, out_dir: Path) -> Path:
        for item in self.source.iterdir():
            shutil.copy(item, out_dir / item.name)
        return out_dir


@pytest.mark.e2e
def test_the_replica_engine_is_local_and_updated_through_its_worker(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs /proc")
    password = "r/e#p?" + secrets.token_hex(12)
    keys = Keys("replica-test:")
    engine_port, worker_port = free_port(), free_port()
    worker_url = f"http://127.0.0.1:{worker_port}"
    weights = tmp_path / "weights"
    weights.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_")}
    env |= {
        "PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "ENGINE": "cpu",
        "MODEL": str(tiny_model_dir), "ENGINE_PORT": str(engine_port), "WEIGHTS_ROOT": str(weights),
        "MEMPO_ENGINE_THREADS": "1", "MEMPO_ENGINE_DRAIN_TIMEOUT_S": "1", "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "MEMPO_ROLLOUT_HOST": "127.0.0.1", "MEMPO_ROLLOUT_PORT": str(worker_port),
        "MEMPO_ROLLOUT_PUBLIC_URL": worker_url, "MEMPO_ROLLOUT_WORKER_ID": "replica-0",
        "MEMPO_ROLLOUT_ADMIN_TOKEN": WORKER_TOKEN, "MEMPO_ROLLOUT_KEY_PREFIX": keys.prefix,
        "MEMPO_ROLLOUT_REDIS_PASSWORD": password, "MEMPO_ROLLOUT_SCORER_URL": "",
        "MEMPO_ROLLOUT_TOKENIZER_PATH": str(tiny_model_dir), "MEMPO_ROLLOUT_CONSUME": "false",
        "MEMPO_ROLLOUT_HEARTBEAT_S": "0.5", "MEMPO_ROLLOUT_DRAIN_TIMEOUT_S": "1",
    }  # fmt: skip
    with RedisServer(tmp_path / "redis", password=password) as server:
        env["MEMPO_ROLLOUT_REDIS_URL"] = f"redis://127.0.0.1:{server.port}/0"
        log = (tmp_path / "replica.log").open("wb")
        replica = subprocess.Popen(
            ["bash", str(REPO / "services/rollout/entrypoint.sh")], env=env, stdout=log, stderr=log
        )
        try:
            wait_ready(worker_url, timeout_s=180, proc=replica)
            check_replica(replica, engine_port, worker_port, worker_url, server, keys, weights, tiny_model_dir)
        finally:
            replica.send_signal(signal.SIGTERM)
            try:
                replica.wait(timeout=30)
            except subprocess.TimeoutExpired:
                replica.kill()
    assert replica.returncode in (0, 143, -signal.SIGTERM), (tmp_path / "replica.log").read_text()[-3000:]


def check_replica(
    replica: subprocess.Popen[bytes], engine_port: int, worker_port: int, worker_url: str,
    server: RedisServer, keys: Keys, weights: Path, model: Path,
) -> None:  # fmt: skip
    assert listening_addresses(engine_port) == {"0100007F"}  # 127.0.0.1 only
    assert listening_addresses(worker_port) == {"0100007F"}
    (engine_pid,) = [p for p in children(replica.pid) if b"engine" in Path(f"/proc/{p}/cmdline").read_bytes()]
    environ = dict(
        item.partition(b"=")[::2] for item in Path(f"/proc/{engine_pid}/environ").read_bytes().split(b"\0") if item
    )  # fmt: skip
    key = environ[b"MEMPO_ENGINE_ADMIN_TOKEN"].decode()
    assert len(key) >= 32 and key != WORKER_TOKEN  # made by the entrypoint
    for pid in (replica.pid, *children(replica.pid)):
        assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    entry = redis.Redis.from_url(server.url).get(keys.engine("replica-0"))
    assert entry is not None and f'"url":"{worker_url}"'.encode() in entry and key.encode() not in entry
    engine_url = f"http://127.0.0.1:{engine_port}"
    body = {"model_path": str(weights / "v1"), "weight_version": "1"}
    with httpx.Client(timeout=30) as http:
        for path in ("/v1/status", "/metrics", "/openapi.json", "/ready"):
            assert key not in http.get(f"{worker_url}{path}").text
        refused = http.post(f"{engine_url}/update_weights_from_disk", json=body,
                            headers={"Authorization": f"Bearer {WORKER_TOKEN}"})  # fmt: skip
        assert refused.status_code in (401, 403), refused.text
    report = asyncio.run(publish_once(server, keys, weights, model))
    assert report.updated == [worker_url] and report.stale == {}, report
    with httpx.Client(timeout=30) as http:
        assert http.get(f"{engine_url}/model_info").json()["weight_version"] == "1"
        assert http.get(f"{worker_url}/v1/status").json()["engine_weight_version"] == "1"


async def publish_once(server: RedisServer, keys: Keys, weights: Path, model: Path) -> PublishReport:
    client = connect(f"redis://127.0.0.1:{server.port}/0", server.password)
    publisher = WeightPublisher(RedisQueue(client, keys), weights, role_tokens={"rollout": WORKER_TOKEN})
    try:
        return await publisher.publish(Exporter(model), version=1)
    finally:
        await publisher.aclose()
        await client.aclose()


def test_the_sglang_engine_gets_its_key_from_a_private_file_not_its_command_line(tmp_path: Path) -> None:
    """ENGINE=sglang once passed --admin-api-key on SGLang's command line (readable by every
    process of the container). A stand-in ``sglang.launch_server`` records what it got."""
    fake = tmp_path / "site" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    record = tmp_path / "record.json"
    (fake / "launch_server.py").write_text(
        "import json, os, stat, sys\n"
        "path = sys.argv[sys.argv.index('--config') + 1]\n"
        "mode = stat.S_IMODE(os.stat(path).st_mode)\n"
        f"open({str(record)!r}, 'w').write(json.dumps({{'argv': sys.argv, 'config': open(path).read(), 'mode': mode}}))\n"
    )
    key = "k'e\"y " + secrets.token_hex(16)  # quotes and a space survive the YAML
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_")}
    env |= {"PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "PYTHONPATH": str(fake.parent),
            "ENGINE": "sglang", "MODEL": "/models/m", "ENGINE_PORT": str(free_port()),
            "MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN": key, "TMPDIR": str(tmp_path)}  # fmt: skip
    done = subprocess.run(
        ["bash", str(REPO / "services/rollout/entrypoint.sh")], env=env, capture_output=True, timeout=60
    )
    assert b"exited before it was healthy" in done.stderr, done.stderr  # the stand-in exits at once
    got = json.loads(record.read_text())
    assert key not in " ".join(got["argv"]) and "--model-path" in got["argv"]
    assert got["mode"] == 0o600
    assert yaml.safe_load(got["config"]) == {"admin-api-key": key}
