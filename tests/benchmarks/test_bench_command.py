"""benchmarks/report.py (run by scripts/bench): runs benchmarks as processes and prints one
markdown table with the machine, each headline figure's median and min-max, goal and verdict;
a failed benchmark is a row and makes the exit status 1, a missing bench extra a skipped row."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CACHE, REPO

pytestmark = pytest.mark.e2e

_spec = importlib.util.spec_from_file_location("bench_report", REPO / "benchmarks" / "report.py")
assert _spec and _spec.loader
report = importlib.util.module_from_spec(_spec)
sys.modules["bench_report"] = report  # dataclasses look their module up there
_spec.loader.exec_module(report)


def test_every_benchmark_has_figures() -> None:
    scripts = {p.stem for p in (REPO / "benchmarks").glob("*.py")} - {"report"}
    assert scripts == set(report.BENCHMARKS)


def test_table_medians_failed_and_skipped_rows() -> None:
    results = [
        report.Result("queue_throughput", {"ratio (streams / raw SET+GET)": [0.52, 0.48, 0.5]}),
        report.Result("weight_publish", {"ratio (publish / copy)": [2.5]}),
        report.Result("agent_overhead", failed="failed (exit 3)"),
        report.Result("learner_vs_trl", skipped=report.SKIP_HINT),
    ]
    rows = report.table(results).splitlines()
    assert rows[0] == "| benchmark | headline figure (median, min-max) | goal | met? |"
    assert "| queue_throughput | ratio (streams / raw SET+GET): 0.5 (0.48-0.52) | >= 0.3 | yes |" in rows
    assert "| weight_publish | ratio (publish / copy): 2.5 | <= 2 | no |" in rows
    assert "| agent_overhead | failed (exit 3) | | |" in rows
    assert "| learner_vs_trl | skipped: pip install -e '.[bench]' | | |" in rows
    assert [report.number(v) for v in (7379.4, 408.0, 47.31, 2.291, 0.2345, 0)] == [
        "7,379", "408", "47.3", "2.29", "0.234", "0",
    ]  # fmt: skip


def test_figures_at_the_largest_k_and_t() -> None:
    lines = [{"questions": 2, "ratio": 0.4}, {"questions": 10, "ratio": 0.25}, {"questions": 4, "ratio": 0.3}]
    (figure,) = report.BENCHMARKS["token_efficiency"]
    assert figure.read(lines) == 0.25


def test_a_failing_benchmark_is_a_row_and_the_rest_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "good.py").write_text('print(\'{"x": 2.0}\')\n')
    (tmp_path / "benchmarks" / "bad.py").write_text("import sys\nprint('boom', file=sys.stderr)\nsys.exit(3)\n")
    (tmp_path / "benchmarks" / "extra.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'trl'\")\n"
    )
    monkeypatch.setattr(report, "REPO", tmp_path)
    for name in ("good", "bad", "extra"):
        monkeypatch.setitem(report.BENCHMARKS, name, [report.Figure("x", report.key("x"), ">=", 1)])
    out = tmp_path / "out"
    out.mkdir()
    good = report.run_benchmark("good", 2, False, out)
    assert good.values == {"x": [2.0, 2.0]} and not good.failed
    assert (out / "good.jsonl").read_text().splitlines() == ['{"x": 2.0}', '{"x": 2.0}']
    bad = report.run_benchmark("bad", 2, False, out)
    assert bad.failed == "failed (exit 3)" and "boom" in (out / "bad.err").read_text()
    extra = report.run_benchmark("extra", 1, False, out)
    assert extra.skipped == report.SKIP_HINT and not extra.failed

    monkeypatch.setattr(sys, "argv", ["report.py", "--reps", "1", "--only", "good,bad,extra", "--out", str(out)])
    with pytest.raises(SystemExit) as exit_:
        report.main()
    assert exit_.value.code == 1  # after every benchmark ran and the table was printed
    assert "| good | x: 2 | >= 1 | yes |" in capsys.readouterr().out


def test_report_runs_two_benchmarks(tmp_path: Path) -> None:
    env = {**os.environ, "MEMPO_CACHE": str(CACHE)}
    only = ["queue_throughput", "agent_overhead"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "report.py"), "--smoke", "--reps", "1",
         "--only", ",".join(only), "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Machine: ") and "CPUs" in lines[0] and "GPU: " in lines[0], lines[0]
    for name in only:
        assert any(line.startswith(f"| {name} | ") for line in lines), proc.stdout
        raw = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        assert len(raw) == 1 and isinstance(json.loads(raw[0]), dict)
    assert "rep 1 of 1" in proc.stderr
