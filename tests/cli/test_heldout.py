"""The demo's held-out check and its display: the question set, the cache, the plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mempo_cli.launcher import heldout
from mempo_cli.launcher.evaluate import EvalOptions, eval_tasks
from mempo_cli.launcher.heldout import HELDOUT, HeldOut, cached_heldout_score, heldout_key
from mempo_cli.launcher.plots import moving_average, plot_run
from mempo_cli.launcher.progress import AVERAGE, Progress, Snapshot
from mempo_sim.world import World


def test_every_held_out_question_once(world: World) -> None:
    tasks = eval_tasks(HELDOUT, 1, "memory")
    held_out = world.split_questions("test")
    assert [t.questions[0] for t in tasks] == [q.text for q in held_out]
    assert len({t.questions[0] for t in tasks}) == len(tasks) > 50
    assert all(t.n == 1 and t.answers == [list(q.answers)] for t, q in zip(tasks, held_out, strict=True))
    with pytest.raises(ValueError, match="1-question"):
        eval_tasks(HELDOUT, 2, "memory")


def _fake_report(em: float) -> dict[str, Any]:
    return {"results": {"memory": {"1": {"em": em, "tasks": 85.0, "format_rate": 0.9}}}}


def test_the_start_score_is_cached_next_to_the_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def evaluate(policy: Path, out: Path, opts: EvalOptions) -> dict[str, Any]:
        calls.append(policy)
        return _fake_report(0.4)

    monkeypatch.setattr(heldout, "evaluate", evaluate)
    policy = tmp_path / "sft"
    policy.mkdir()
    first = cached_heldout_score(policy, tmp_path / "eval")
    assert first == HeldOut(em=0.4, questions=85, format_rate=0.9) and len(calls) == 1
    assert cached_heldout_score(policy, tmp_path / "eval") == first and len(calls) == 1  # read back
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["results"]["memory"]["1"]["em"] == 0.4
    other = EvalOptions(ks=(1,), modes=("memory",), every_question=True, max_new_tokens=8)
    assert heldout_key(other) != heldout_key()
    cached_heldout_score(policy, tmp_path / "eval", other)  # other options: measured again
    (policy / "heldout.json").write_text("{torn")
    cached_heldout_score(policy, tmp_path / "eval")  # a torn cache: measured again
    assert len(calls) == 3


def test_moving_average_matches_a_plain_loop() -> None:
    values = [0.0, 1.0, 0.5, 0.25, 1.0, 0.0, 0.75]
    for window in (1, 3, 8):
        expected = []
        for i in range(len(values)):
            recent = values[max(0, i - window + 1) : i + 1]
            expected.append(sum(recent) / len(recent))
        assert moving_average(values, window) == pytest.approx(expected)


def test_reward_plot_shows_the_held_out_scores(tmp_path: Path) -> None:
    rows = [{"step": s, "reward_mean": s / 10, "correct_rate": s / 10, "format_rate": 0.9} for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = plot_run(tmp_path / "metrics.jsonl", tmp_path)
    size = (tmp_path / "reward.png").stat().st_size
    (tmp_path / "heldout.json").write_text(json.dumps({"start": {"em": 0.4}, "end": {"em": 0.5}, "end_step": 10}))
    assert plot_run(tmp_path / "metrics.jsonl", tmp_path) == plain
    assert (tmp_path / "reward.png").stat().st_size != size  # the held-out markers are drawn


def test_progress_shows_the_reward_moving_average(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress(steps=20, enabled=True, heading="held-out EM before RL: 0.400")
    with progress:
        for step, reward in enumerate([0.0, 1.0, 0.5], start=1):
            metrics = {"step": step, "reward_mean": reward}
            progress.update(Snapshot({"step": step, "last_metrics": metrics}, {}, 0.0))
    out = capsys.readouterr().out
    assert "held-out EM before RL: 0.400" in out
    assert progress.rows[-1][2] == "0.500" and AVERAGE >= 3  # mean of 0, 1, 0.5


def test_each_progress_line_shows_its_own_steps_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """The learner's step moves on before that step's metrics are written: a status that
    says step 13 while its last metrics are still step 12's must not print step 12's
    figures as step 13 (seen on a fresh clone)."""
    progress = Progress(steps=20, enabled=True)
    with progress:
        for status_step, metrics_step, reward in [(12, 12, 0.25), (13, 12, 0.25), (13, 13, 0.75)]:
            metrics = {"step": metrics_step, "version": metrics_step, "reward_mean": reward}
            progress.update(Snapshot({"step": status_step, "last_metrics": metrics}, {}, 0.0))
    lines = [line for line in capsys.readouterr().out.splitlines() if "step 1" in line]
    assert [row[0] for row in progress.rows] == ["12", "13"]
    assert [row[1] for row in progress.rows] == ["0.250", "0.750"]
    assert len(lines) == 2 and "reward=0.750" in lines[1] and lines[1].startswith("[mempo up] step 13/20")
