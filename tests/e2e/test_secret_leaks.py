"""No secret ever reaches a log, a status page or a file of a run.

Real processes: the ``mempo up`` services (``start_services``, with the random admin
token it makes for each) on a redis-server with a password, logging at DEBUG; refused
admin calls with wrong tokens, one training step whose weights the learner pushes with
the token, a Redis outage (every service logs its connection errors); then neither token,
the password nor the wrong tokens appear in any log, any file of the run (checkpoints,
metrics, weights, Redis's log and append-only file) or any status page.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.e2e.live_services import refused

TOKEN = secrets.token_hex(16)
WRONG = secrets.token_hex(16)



def process_environment(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        pytest.skip("needs /proc to read what the children were given")
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


@pytest.mark.e2e
def test_no_secret_reaches_a_log_a_file_or_a_status_page(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``mempo up``'s services (its own random secret per service: the scorer's token, the
    workers' token, each engine's key; TOKEN on retrieval and the learner) on a Redis with
    a password, logging at DEBUG. The learner updates each engine through its worker."""
    from mempo.procs import RedisServer
    from mempo_cli.launcher import up
    from mempo_cli.launcher.supervisor import Supervisor
    from tests.e2e.live_services import find_secrets

    password = secrets.token_hex(16)
    given: dict[str, dict[str, object]] = {service: {"log_level": "DEBUG"} for service in up.SERVICES}
    for service in ("retrieval", "learner"):
        given[service]["admin_token"] = TOKEN
    given["learner"].update(preset=None, total_steps=1, questions_per_task=[1], group_size=2,
                            batch_groups=1, max_rounds=2, max_staleness=0)  # fmt: skip
    opts = up.UpOptions(name="secrets", runs_root=tmp_path, display=False, given=given, ready_timeout_s=180)
    run_dir = opts.run_dir.resolve()
    redis = RedisServer(run_dir / "redis", appendonly=True, password=password).start()
    try:
        assert redis.ping(password="").startswith(b"-NOAUTH")  # the password is required
        with Supervisor(run_dir) as sup:
            ends = up.start_services(sup, opts, tiny_model_dir, redis.url)
            env = {c.name: process_environment(c.proc.pid) for c in sup.children}
            run = SimpleNamespace(
                engine=env["engine-0"]["MEMPO_ENGINE_ADMIN_TOKEN"],
                worker=env["worker-0"]["MEMPO_ROLLOUT_ADMIN_TOKEN"],
                scorer=env["scorer"]["MEMPO_SCORER_ADMIN_TOKEN"],
            )
            owned = {run.engine, run.worker, run.scorer, TOKEN}
            assert len(owned) == 4 and min(map(len, owned)) >= 16  # one secret per service
            assert env["worker-0"]["MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN"] == run.engine
            assert run.engine not in "".join(env["learner"].values())  # the worker's alone
            assert env["learner"]["MEMPO_LEARNER_WORKER_ADMIN_TOKEN"] == run.worker
            assert env["learner"]["MEMPO_LEARNER_SCORER_ADMIN_TOKEN"] == run.scorer
            assert all(password in e[f"MEMPO_{p}_REDIS_URL"] for e, p in (
                (env["scorer"], "SCORER"), (env["worker-0"], "ROLLOUT"), (env["learner"], "LEARNER")
            ))  # fmt: skip
            pages = exercise(ends, run_dir / "weights", run)
            redis.stop()  # an outage: the services log their connection errors
            time.sleep(3.0)
            redis.start()
            sup.wait_ready(sup.children, 60)  # every service is back
            pages |= {f"after the outage: {k}": v for k, v in status_pages(ends).items()}
            sup.check()
    finally:
        redis.stop()
    secret = {"engine key": run.engine, "worker token": run.worker, "scorer token": run.scorer,
              "admin token": TOKEN, "redis password": password, "wrong token": WRONG}  # fmt: skip
    leaks = [f"{name}: {label}" for name, page in pages.items()
             for label, value in secret.items() if value in page]  # fmt: skip
    assert not leaks, f"secrets in status pages: {leaks}"
    logs = sorted((run_dir / "logs").glob("*.log"))
    assert len(logs) == 5 and all(p.stat().st_size > 0 for p in logs), logs
    assert any(" DEBUG " in p.read_text() for p in logs), "the services did not log at DEBUG"
    assert (run_dir / "redis" / "redis.log").stat().st_size > 0
    assert not find_secrets(run_dir, secret), "secrets on disk"


def exercise(ends: Any, weights_root: Path, run: SimpleNamespace) -> dict[str, str]:
    """Refused admin calls, one training step with its weight push; every status page.
    The learner's admin calls go to the scorer and to the workers (which forward to their
    engines), each with its own token; no other service's secret opens an engine."""
    admin = [(ends.scorer, run.scorer), *[(w, run.worker) for w in ends.workers]]
    admin += [(e, run.engine) for e in ends.engines]
    admin_urls = [ends.scorer, *ends.engines]  # where the weight version shows
    with httpx.Client(timeout=30) as http:
        for base, token in admin:
            body = {"model_path": str(weights_root / "v0"), "weight_version": "5"}
            others = refused(token, WRONG) + [
                ({"Authorization": f"Bearer {other}"}, 403)
                for other in (run.engine, run.worker, run.scorer, TOKEN) if other != token
            ]  # fmt: skip
            for headers, status in others:
                if any(v != v.strip() for v in headers.values()):
                    continue  # h11 will not send a header value with trailing whitespace
                reply = http.post(f"{base}/update_weights_from_disk", json=body, headers=headers)
                want = 401 if base in ends.engines else status  # the CPU engine: as SGLang
                assert reply.status_code == want, (base, headers, reply.text)
            outside = {"model_path": "/etc", "weight_version": "5"}
            right = {"Authorization": f"Bearer {token}"}
            reply = http.post(f"{base}/update_weights_from_disk", json=outside, headers=right)
            assert reply.status_code == 403, reply.text
        deadline = time.monotonic() + 120
        while True:  # the learner trains one step and pushes v1 with the token
            status = http.get(f"{ends.learner}/v1/status").json()
            versions = [http.get(f"{u}/model_info").json()["weight_version"] for u in admin_urls]
            if status["step"] >= 1 and versions == [str(status["version"])] * len(versions):
                break
            assert status["state"] != "failed", status
            assert time.monotonic() < deadline, f"no weight push: {status}, {versions}"
            time.sleep(1.0)
        assert status["version"] >= 1, status
        # The learner called the scorer and the workers, never an engine.
        assert status["last_publish"]["updated"] == sorted([ends.scorer, *ends.workers]), status
    return status_pages(ends)


def status_pages(ends: Any) -> dict[str, str]:
    """Every read-only page of every service, fetched without a token."""
    pages = {}
    services = {"retrieval": ends.retrieval, "scorer": ends.scorer, "learner": ends.learner}
    services |= {f"engine-{i}": u for i, u in enumerate(ends.engines)}
    services |= {f"worker-{i}": u for i, u in enumerate(ends.workers)}
    with httpx.Client(timeout=30) as http:
        for name, base in services.items():
            for path in ("/metrics", "/v1/status", "/model_info", "/server_info", "/v1/info",
                         "/ready", "/health", "/openapi.json"):  # fmt: skip
                reply = http.get(f"{base}{path}")
                if reply.status_code != 404:
                    assert reply.status_code == 200, (name, path, reply.text)  # no token needed
                    pages[f"{name}{path}"] = reply.text
    assert {"learner/v1/status", "worker-0/v1/status", "engine-0/server_info"} <= set(pages)
    return pages
