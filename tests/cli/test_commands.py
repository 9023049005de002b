"""The core CLI: bad arguments exit 2 with a message; ``mempo plot`` draws a run's figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mempo_cli.launcher.plots import PANELS
from mempo_cli.main import app

runner = CliRunner()


def test_plot_draws_every_panel_of_a_run(tmp_path: Path) -> None:
    rows = [
        {"step": s, "reward_mean": 0.1 * s, "correct_rate": 0.1 * s, "format_rate": 1.0,
         "mem_reward_mean": 0.01, "p_mem_mean": 0.2, "p_full_mean": 0.19,
         "tokens_per_trajectory": 900.0, "kl": 0.001, "pg_clipfrac": 0.0, "ppo_kl": 0.0}
        for s in range(1, 4)
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    result = runner.invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for name, _, _ in PANELS:
        assert (tmp_path / name).stat().st_size > 1000
        assert str(tmp_path / name) in result.output


@pytest.mark.parametrize(
    ("content", "message"), [(None, "not found"), ('{"step": 1}\n', "no step with figures")]
)
def test_plot_refuses_a_folder_without_figures(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    result = runner.invoke(app, ["plot", str(tmp_path)])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "--model", "/nonexistent"], "not an HF model folder"),
        (["tiny", "build", "--out", "x", "--preset", "huge"], "unknown preset"),
        (["tiny", "build"], "give --out DIR or --ship"),
        (["tiny", "build", "--out", "x", "--ship"], "give --out DIR or --ship"),
        (["world", "corpus", "--out", "x.jsonl", "--people", "400"], "pool names"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str) -> None:
    result = runner.invoke(app, argv)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_eval_every_question_wants_k_1(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = runner.invoke(app, ["eval", "--model", str(tmp_path), "--ks", "1,2", "--every-question"])
    assert result.exit_code == 2 and "--every-question" in result.output


def test_eval_wants_an_http_engine_url(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = runner.invoke(app, ["eval", "--model", str(tmp_path), "--engine-url", "localhost:30000"])
    assert result.exit_code == 2 and "--engine-url must be an http" in result.output


def test_redis_server_starts_from_a_relative_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mempo.procs import RedisServer

    monkeypatch.chdir(tmp_path)
    server = RedisServer(Path("runs/x/redis"), appendonly=True).start()  # as `mempo up` passes it
    try:
        assert (tmp_path / "runs/x/redis/redis.log").exists()
    finally:
        server.stop()


def test_redis_server_with_a_password_refuses_clients_without_it(tmp_path: Path) -> None:
    import redis

    from mempo.procs import RedisServer

    with RedisServer(tmp_path / "redis", password="s3cret") as server:
        assert server.ping(password="").startswith(b"-NOAUTH")
        assert server.url == f"redis://:s3cret@127.0.0.1:{server.port}/0"
        assert redis.Redis.from_url(server.url).ping()
