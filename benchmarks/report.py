"""Run every benchmark and print one markdown table: headline figure, goal, met or not.

Each benchmark runs ``--reps`` times as its own process (``benchmarks/<name>.py``, from the
repository root); every JSON line it prints is saved to ``<out>/<name>.jsonl``. The table
shows each headline figure's median over the repetitions and its min-max. A benchmark that
exits non-zero is a "failed" row (its stderr tail in ``<out>/<name>.err``) and the others
still run; one whose ``bench`` extra (trl, datasets) is missing is a "skipped" row. Exits 1
when any failed. ``learning_curve`` (tens of minutes a run) only runs with ``--only``.

    python benchmarks/report.py [--reps 3] [--smoke] [--only a,b] [--out runs/bench]
    scripts/bench [same arguments]   # bootstraps first (the bench extra included)
"""

from __future__ import annotations

import argparse
import datetime
import json
import operator
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
Lines = list[dict]  # the JSON lines one run of a benchmark printed


@dataclass(frozen=True)
class Figure:
    """One headline figure: how to read it from a run's JSON lines, and its goal."""

    label: str
    read: Callable[[Lines], float]
    op: str  # one of OPS
    goal: float


OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt, "==": operator.eq,
}  # fmt: skip


def key(name: str) -> Callable[[Lines], float]:
    """The figure ``name`` of the run's last JSON line."""
    return lambda lines: float(lines[-1][name])


def at_largest(by: str, name: str) -> Callable[[Lines], float]:
    """The figure ``name`` of the line with the largest ``by`` (e.g. the largest k)."""
    return lambda lines: float(max(lines, key=lambda line: line[by])[name])


# benchmark: its headline figures and goals (each benchmark's docstring states them)
BENCHMARKS: dict[str, list[Figure]] = {
    "queue_throughput": [Figure("ratio (streams / raw SET+GET)", key("ratio"), ">=", 0.3)],
    "retrieval_qps": [
        Figure("bm25_qps", key("bm25_qps"), ">=", 1000),
        Figure("ratio (vs rank-bm25)", key("ratio"), ">=", 50),
        Figure("library_ratio (vs bm25s's own top-k)", key("library_ratio"), ">=", 1),
    ],
    "scorer_prefix_sharing": [
        Figure("shared_over_forward, largest T", at_largest("rounds", "shared_over_forward"), "<=", 1.2),
        Figure("speedup_vs_naive, largest T", at_largest("rounds", "speedup_vs_naive"), ">=", 5),
    ],
    "token_efficiency": [Figure("ratio (memory / full), largest k", at_largest("questions", "ratio"), "<=", 0.30)],
    "agent_overhead": [
        Figure("ms_per_round", key("ms_per_round"), "<", 5),
        Figure("errors (concurrent episodes)", key("errors"), "==", 0),
    ],
    "learner_vs_trl": [Figure("ratio (ours / TRL tok/s)", key("ratio"), ">=", 1.5)],
    "weight_publish": [Figure("ratio (publish / copy)", key("ratio"), "<=", 2)],
    "weights_io": [
        Figure("write_ratio (ours / safetensors)", key("write_ratio"), "<=", 1),
        Figure("load_ratio (ours / safetensors)", key("load_ratio"), "<=", 1),
    ],
    "learning_curve": [
        Figure("mempo_em - sft_em", lambda lines: lines[-1]["mempo_em"] - lines[-1]["sft_em"], ">=", 0.10),
    ],
}
LONG = {"learning_curve"}  # left out of the default set
SKIP_HINT = "skipped: pip install -e '.[bench]'"
MISSING_EXTRA = re.compile(r"ModuleNotFoundError: No module named '(trl|datasets)[.']")


@dataclass
class Result:
    """What the repetitions of one benchmark gave: figures per repetition, or why none."""

    name: str
    values: dict[str, list[float]] = field(default_factory=dict)  # figure label: one per rep
    failed: str = ""  # e.g. "failed (exit 1)"; empty when it ran
    skipped: str = ""


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def run_benchmark(name: str, reps: int, smoke: bool, out: Path) -> Result:
    result = Result(name)
    (out / f"{name}.err").unlink(missing_ok=True)
    with (out / f"{name}.jsonl").open("w", encoding="utf-8") as raw:
        for rep in range(1, reps + 1):
            command = [sys.executable, str(REPO / "benchmarks" / f"{name}.py")]
            if smoke:
                command.append("--smoke")
            if name == "learning_curve":  # it resumes from its --out: one folder per repetition
                command += ["--out", str(out / name / f"{'smoke-' if smoke else ''}rep{rep}")]
            log(f"{name}: rep {rep} of {reps} ...")
            started = time.monotonic()
            proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
            log(f"{name}: rep {rep} of {reps} done in {time.monotonic() - started:.1f} s (exit {proc.returncode})")
            if proc.returncode != 0:
                if MISSING_EXTRA.search(proc.stderr):
                    result.skipped = SKIP_HINT
                    log(f"{name}: {SKIP_HINT}")
                else:
                    result.failed = f"failed (exit {proc.returncode})"
                    (out / f"{name}.err").write_text(proc.stderr[-5000:], encoding="utf-8")
                    log(f"{name}: failed, the end of its stderr is in {out / f'{name}.err'}")
                return result
            lines = [line for line in proc.stdout.splitlines() if line.strip()]
            raw.writelines(line + "\n" for line in lines)
            try:
                parsed = [json.loads(line) for line in lines]
                for figure in BENCHMARKS[name]:
                    result.values.setdefault(figure.label, []).append(figure.read(parsed))
            except (ValueError, KeyError, IndexError, TypeError) as error:
                result.failed = f"failed: cannot read its figures ({type(error).__name__}: {error}; see {name}.jsonl)"
                return result
    return result


def number(value: float) -> str:
    """1,000 / 408 / 47.3 / 2.29 / 0.234: three significant digits, no exponent."""
    if abs(value) >= 100 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.3g}"


def cell(values: list[float]) -> str:
    """Median, and min-max when there are several repetitions."""
    text = number(statistics.median(values))
    if len(values) > 1:
        text += f" ({number(min(values))}-{number(max(values))})"
    return text


def table(results: list[Result]) -> str:
    rows = ["| benchmark | headline figure (median, min-max) | goal | met? |", "|---|---|---|---|"]
    for result in results:
        if result.failed or result.skipped:
            rows.append(f"| {result.name} | {result.failed or result.skipped} | | |")
            continue
        for figure in BENCHMARKS[result.name]:
            values = result.values[figure.label]
            met = OPS[figure.op](statistics.median(values), figure.goal)
            goal = f"{figure.op} {number(figure.goal)}"
            rows.append(f"| {result.name} | {figure.label}: {cell(values)} | {goal} | {'yes' if met else 'no'} |")
    return "\n".join(rows)


def machine() -> str:
    cpu = platform.processor() or platform.machine() or "unknown CPU"
    memory = ""
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        kb = re.search(r"MemTotal:\s+(\d+) kB", meminfo.read_text())
        memory = f", {int(kb.group(1)) / 2**20:.1f} GiB memory" if kb else ""
    gpu = "none"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return f"Machine: {os.cpu_count()} CPUs ({cpu}){memory}, GPU: {gpu}; {date}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="runs of each benchmark")
    parser.add_argument("--smoke", action="store_true", help="each benchmark's tiny sizes: checks they run, proves nothing")
    parser.add_argument("--only", default="", help=f"comma-separated, from: {','.join(BENCHMARKS)}")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"), help="raw JSON lines and error logs")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or [n for n in BENCHMARKS if n not in LONG]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    started = time.monotonic()
    results = [run_benchmark(name, args.reps, args.smoke, out) for name in names]
    log(f"all done in {time.monotonic() - started:.0f} s; raw JSON lines in {out}")
    notes = [f"{args.reps} repetition(s) each" + (", --smoke sizes: the figures prove nothing" if args.smoke else "")]
    if not args.only:
        notes.append("learning_curve (tens of minutes) is left out: run it with --only learning_curve")
    print(machine())
    print()
    print(table(results))
    print()
    print("Note: " + "; ".join(notes) + ".")
    if any(result.failed for result in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
