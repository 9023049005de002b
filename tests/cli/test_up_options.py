"""``mempo up``'s command line: every option that feeds a service's setting shows that
setting's value as its default, reaches the child's settings object, and a bad value
exits 2 naming the option; no service variable is spelled by hand in the launcher."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mempo.settings import settings_env
from mempo_cli.launcher.up import SERVICES, UpOptions, plan
from mempo_cli.launcher.up_options import FEEDS, OWN, parse_up, setting_value
from mempo_cli.main import app
from services.learner.settings import LearnerSettings
from services.rollout.settings import WorkerSettings
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def _no_service_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in __import__("os").environ if k.startswith("MEMPO_")]:
        monkeypatch.delenv(key)


def _help_defaults() -> dict[str, str | None]:
    """option -> the default ``mempo up --help`` shows for it (None: none shown)."""
    result = CliRunner().invoke(app, ["up", "--help"])
    assert result.exit_code == 0, result.output
    entries = re.split(r"\n\s+(?=--[a-z])", result.output.split("Options:", 1)[1])
    shown: dict[str, str | None] = {}
    for entry in entries:
        text = " ".join(entry.split())
        if match := re.match(r"--([a-z-]+)", text):
            default = re.search(r"\[default: (.*?)\]", text)
            shown[match.group(1).replace("-", "_")] = default.group(1) if default else None
    return shown


def _shown(value: object) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def test_every_option_is_listed_with_the_default_of_the_setting_it_feeds(tmp_path: Path) -> None:
    shown = _help_defaults()
    assert set(OWN) | set(FEEDS) <= set(shown), set(OWN) | set(FEEDS) - set(shown)
    services = plan(parse_up([]), tmp_path, "redis://127.0.0.1:1/0")
    started = {"learner": services.learner, "worker": services.workers[0]}
    tiny = {"learner": LearnerSettings(preset="tiny"), "worker": WorkerSettings(preset="tiny")}
    for option, (service, path) in FEEDS.items():
        value = setting_value(started[service], path)
        assert shown[option] == _shown(value), f"--{option}: shows {shown[option]}, starts {value}"
        assert value == setting_value(tiny[service], path), f"--{option} is not the tiny preset's"
    assert shown["seed"] == "0" and shown["rollout_replicas"] == "1"


def test_the_demo_recipe_is_the_tiny_preset() -> None:
    """The figures of README and docs/results.md were measured with these values."""
    learner = LearnerSettings(preset="tiny")
    t = learner.trainer
    assert (learner.total_steps, learner.questions_per_task, learner.group_size) == (30, [1], 8)
    assert (learner.batch_groups, learner.max_rounds, learner.max_staleness) == (8, 6, 1)
    assert (t.lr, t.warmup_steps, t.decay_steps, t.ppo_epochs, t.beta_kl) == (3e-4, 0, 0, 2, 0.02)
    assert (t.alpha, t.mem_min_std, t.neg_adv_scale, t.mem_loss) == (0.0, 0.05, 0.2, "shared")
    assert WorkerSettings(preset="tiny").max_new_tokens == 256


def test_options_reach_the_settings_each_child_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opts = parse_up(["--lr", "0.001", "--questions", "1-2", "--reward", "f1", "--alpha", "1",
                     "--mode", "full", "--seed", "7", "--rollout-replicas", "2", "--max-new-tokens", "64"])  # fmt: skip
    services = plan(opts, tmp_path, "redis://127.0.0.1:1/0")
    learner = services.learner
    assert (learner.trainer.lr, learner.trainer.alpha, learner.questions_per_task) == (
        0.001,
        1.0,
        [1, 2],
    )
    assert (learner.mode, learner.task_seed, learner.trainer.seed) == ("full", 7, 7)
    assert learner.trainer.ppo_epochs == 2  # not given: the preset's
    assert [e.seed for e in services.engines] == [7, 8]
    assert {w.reward_kind for w in services.workers} == {"f1"}
    assert {w.max_new_tokens for w in services.workers} == {64}
    assert {w.scorer_url for w in services.workers} == {""}  # full mode: no memory scoring
    assert services.workers[0].engine_admin_token != services.workers[1].engine_admin_token
    for key, value in settings_env(learner).items():
        monkeypatch.setenv(key, value)
    assert LearnerSettings() == learner


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "both"], "--mode: Input should be 'memory' or 'full'"),
        (["--reward", "accuracy"], "--reward: Input should be 'em', 'fraction' or 'f1'"),
        (["--neg-adv-scale", "0"], "--neg-adv-scale: Input should be greater than 0"),
        (["--questions", "0"], "--questions: Value error"),
        (["--lr", "fast"], "--lr: Input should be a valid number"),
        (
            ["--rollout-replicas", "17"],
            "--rollout-replicas: Input should be less than or equal to 16",
        ),
        (["--model", "/nonexistent"], "not an HF model folder"),
        (["--no-such-option"], "No such option"),
    ],
)
def test_a_bad_option_exits_2_naming_it(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["up", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_no_service_variable_is_spelled_by_hand_in_the_launcher() -> None:
    """Each child's environment is its settings object's (mempo.settings.settings_env)."""
    prefixes = "|".join(str(c.model_config["env_prefix"]) for c in SERVICES.values())
    names = re.compile(rf"(?:{prefixes})[A-Z_]+")
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted((REPO / "mempo_cli" / "launcher").glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if names.search(line)
    ]
    assert not found, "\n".join(found)


def test_given_settings_lie_over_the_launchers(tmp_path: Path) -> None:
    opts = UpOptions(given={"learner": {"preset": None, "device": "cpu", "trainer": {"lr": 0.5}}})
    learner = plan(opts, tmp_path, "redis://127.0.0.1:1/0").learner
    assert (learner.device, learner.trainer.lr, learner.group_size) == (
        "cpu",
        0.5,
        4,
    )  # no preset: defaults
    assert learner.trainer.seed == 0 and learner.run_dir == (opts.run_dir.resolve())
