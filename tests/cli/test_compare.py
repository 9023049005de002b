"""``mempo runs compare``: two runs on one PNG and a table of their final figures; a run
without steps, or two runs with one label, exit 2 naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mempo_cli.main import app

runner = CliRunner()


def write_run(folder: Path, rewards: list[float], heldout: bool) -> Path:
    folder.mkdir(parents=True)
    rows = [{"step": s, "time": 100.0 + 10 * s, "reward_mean": r, "correct_rate": r / 2, "p_mem_mean": 0.2,
             "p_full_mean": 0.1, "tokens_per_trajectory": 300 + s, "kl": 0.01 * s}
            for s, r in enumerate(rewards, start=1)]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "torn')
    if heldout:
        (folder / "heldout.json").write_text(json.dumps({"start": {"em": 0.3}, "end": {"em": 0.5}, "end_step": 8}))
    return folder


def test_two_runs_are_drawn_and_tabled(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.8, 0.6], heldout=True)
    b = write_run(tmp_path / "b", [0.1] * 4, heldout=False)
    out = tmp_path / "cmp" / "runs.png"
    result = runner.invoke(app, ["runs", "compare", str(a), str(b), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 10_000
    table = json.loads(out.with_suffix(".json").read_text())
    assert table["a"]["steps"] == 8 and table["a"]["reward"] == 0.6
    assert table["a"]["em_last_quarter"] == (0.8 / 2 + 0.6 / 2) / 2  # the last 2 of 8 steps
    assert (table["a"]["heldout_em_start"], table["a"]["heldout_em_end"]) == (0.3, 0.5)
    assert table["a"]["wall_s"] == 70.0 and table["a"]["kl"] == 0.08
    assert table["b"]["heldout_em_end"] is None and table["b"]["steps"] == 4
    assert "em_last_quarter" in result.output


def test_bad_runs_exit_2_naming_the_problem(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", [0.1, 0.2], heldout=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    for args, message in [
        ([str(a), str(empty)], "no metrics.jsonl with a step"),
        ([str(a), str(a)], "same label"),
        ([str(a), "--labels", "x,y"], "--labels has 2 names for 1 runs"),
    ]:
        result = runner.invoke(app, ["runs", "compare", *args, "--out", str(tmp_path / "x.png")])
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output
