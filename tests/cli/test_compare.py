"""``mempo runs compare``: two runs on one PNG and a table of their final figures (printed
and as JSON); bad input (no run, a run without steps, two runs with one label, an --out
that is not a PNG) exits 2 naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mempo_cli.launcher.compare import HELDOUT_TITLE, draw_runs, load_runs
from mempo_cli.main import app

runner = CliRunner()


def write_run(folder: Path, rewards: list[float], heldout: bool) -> Path:
    """A run folder: a metrics line per reward (its last line torn, as a crash leaves it)
    and, with ``heldout``, a heldout.json."""
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
    assert list(table) == ["a", "b"]
    assert table["a"]["steps"] == 8 and table["a"]["reward"] == 0.6
    assert table["a"]["reward_avg8"] == sum([0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 0.8, 0.6]) / 8
    assert table["a"]["em_last_quarter"] == (0.8 / 2 + 0.6 / 2) / 2  # the last 2 of 8 steps
    assert (table["a"]["heldout_em_start"], table["a"]["heldout_em_end"]) == (0.3, 0.5)
    assert table["a"]["wall_s"] == 70.0 and table["a"]["kl"] == 0.08 and table["a"]["tokens_per_task"] == 308
    assert table["b"]["steps"] == 4 and table["b"]["em_last_quarter"] == 0.05  # the last 1 of 4 steps
    assert table["b"]["heldout_em_end"] is None and table["b"]["p_mem"] == 0.2
    assert "0.300 -> 0.500" in result.output and "em_last_quarter" in result.output


def test_labels_name_the_runs(tmp_path: Path) -> None:
    a = write_run(tmp_path / "x" / "run", [0.1, 0.2], heldout=False)
    b = write_run(tmp_path / "y" / "run", [0.3], heldout=False)
    out = tmp_path / "two.png"
    result = runner.invoke(app, ["runs", "compare", str(a), str(b), "--out", str(out), "--labels", "grpo, mempo"])
    assert result.exit_code == 0, result.output
    assert list(json.loads(out.with_suffix(".json").read_text())) == ["grpo", "mempo"]


def test_the_heldout_panel_only_when_a_run_has_one(tmp_path: Path) -> None:
    plain = write_run(tmp_path / "plain", [0.1, 0.2, 0.3], heldout=False)
    scored = write_run(tmp_path / "scored", [0.1, 0.2, 0.3], heldout=True)
    without = draw_runs(load_runs([plain], ["plain"]), tmp_path / "one.png")
    with_it = draw_runs(load_runs([plain, scored], ["plain", "scored"]), tmp_path / "two.png")
    assert HELDOUT_TITLE not in without and len(without) == 4
    assert HELDOUT_TITLE in with_it and len(with_it) == 5


def test_a_run_lacking_a_figure_has_none(tmp_path: Path) -> None:
    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    result = runner.invoke(app, ["runs", "compare", str(folder), "--out", str(tmp_path / "bare.png")])
    assert result.exit_code == 0, result.output
    figures = json.loads((tmp_path / "bare.json").read_text())["bare"]
    assert figures["reward"] == 0.5 and figures["kl"] is None and figures["wall_s"] is None


def test_bad_input_exits_2_naming_the_problem(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", [0.1, 0.2], heldout=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "metrics.jsonl").write_text('{"step": 1, "rew')
    png = ["--out", str(tmp_path / "x.png")]
    for args, message in [
        (png, "Missing argument"),
        ([str(a), str(empty), *png], f"{empty}: no metrics.jsonl"),
        ([str(a), str(torn), *png], "holds no step"),
        ([str(a), str(a), *png], "same label a"),
        ([str(a), "--labels", "x,y", *png], "--labels has 2 names for 1 runs"),
        ([str(a), str(a), "--labels", "x,", *png], "non-empty label"),
        ([str(a), "--out", str(tmp_path / "x.json")], "must be a .png"),
    ]:
        result = runner.invoke(app, ["runs", "compare", *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
        assert "Traceback" not in result.output
    assert not (tmp_path / "x.png").exists()
