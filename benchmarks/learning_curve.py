"""Learning proof: the tiny agent learns on CPU, and the memory advantage matters.

Through the real commands and services, with a fixed seed:

1. SFT warm start (``mempo sft``) of the tiny policy (preset ``reader``: pretrained,
   cached) on oracle trajectories of 8 worlds (memory mode; ``--sft-mode both`` adds full);
2. eval of the SFT policy (``mempo eval``) on held-out tasks (test split: entities the
   training never asked about), memory mode and full mode, with P_mem scored;
3. MemPO RL (``mempo up``, memory advantage alpha = 1) for ``--rl-steps`` steps from the
   SFT policy, then eval of its last weights;
4. the same RL budget with the memory advantage off (``--alpha 0``: plain GRPO with the
   same ``<mem>`` format), then eval.

``--mem-min-std`` passes ``mempo up --mem-min-std`` to the MemPO run (pools whose
P_mem - P_full std is below it get no memory advantage; default mempo.advantages.MEM_MIN_STD).

Prints one JSON line {"sft_em", "mempo_em", "grpo_em", "sft_p_mem", "mempo_p_mem",
"grpo_p_mem", "mempo_tokens_per_task", "full_mode_tokens_per_task", "minutes", ...}
(EM and P_mem: held-out memory-mode tasks, greedy decoding; tokens: the MemPO policy in
memory mode vs the same policy with the full history; minutes: MemPO's RL wall time),
and writes ``curves.png`` and ``summary.json`` to ``--out``.
Goals: mempo_em - sft_em >= 0.10 within 30 minutes of RL; mempo_p_mem > grpo_p_mem;
mempo_tokens_per_task < full_mode_tokens_per_task. docs/results.md reads the numbers.

    python benchmarks/learning_curve.py [--out runs/learning-curve] [--rl-steps 60]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mempo.advantages import MEM_MIN_STD
from mempo.launcher.plots import moving_average, read_metrics
from mempo.tiny import PRESETS, default_cache_dir, ensure_tiny

MEMPO = [sys.executable, "-m", "mempo.cli"]


def run(step: str, argv: list[str]) -> float:
    """Run one mempo command, its output passed through; returns its wall minutes."""
    print(f"[learning-curve] {step}: mempo {' '.join(argv)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    subprocess.run([*MEMPO, *argv], check=True, stdout=sys.stderr)
    return (time.monotonic() - started) / 60


def evaluate(model: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Held-out figures averaged over --ks: {memory: {em, p_mem, ...}, full: {...}}."""
    if not (out / "eval.json").exists():
        run(f"eval {model}", ["eval", "--model", str(model), "--ks", args.ks, "--tasks", str(args.eval_tasks),
                              "--modes", "memory,full", "--score", "--out", str(out)])  # fmt: skip
    results = json.loads((out / "eval.json").read_text())["results"]
    # P_mem is missing for a k where no episode wrote a memory: averaged over the others.
    return {
        mode: {
            key: statistics.fmean(r[key] for r in by_k.values() if key in r)
            for key in dict.fromkeys(key for r in by_k.values() for key in r)
        }
        for mode, by_k in results.items()
    }


def train(name: str, sft: Path, alpha: float, args: argparse.Namespace) -> tuple[Path, float]:
    """MemPO RL (alpha > 0) or plain GRPO (alpha = 0) from the SFT policy; returns the
    last published weights and the wall minutes of the run."""
    run_dir = args.out / name
    summary = run_dir / "up.json"
    if not summary.exists():
        minutes = run(name, ["up", "--model", str(sft), "--name", name, "--runs-root", str(args.out),
                             "--steps", str(args.rl_steps), "--alpha", str(alpha), "--lr", str(args.rl_lr),
                             "--questions", args.questions, "--group-size", str(args.group_size),
                             "--batch-groups", str(args.batch_groups), "--seed", str(args.seed),
                             "--mem-min-std", str(args.mem_min_std), "--no-heldout", "--no-display"])  # fmt: skip
        version = max(int(p.name[1:]) for p in (run_dir / "weights").glob("v*") if p.name[1:].isdigit())
        summary.write_text(json.dumps({"minutes": minutes, "version": version}))
    done = json.loads(summary.read_text())
    return run_dir / "weights" / f"v{done['version']}", float(done["minutes"])


def plot(out: Path, evals: dict[str, dict[str, Any]], min_std: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8), dpi=110)
    mempo = f"MemPO (alpha=1{f', min std {min_std}' if min_std else ''})"
    for name, label in (("mempo", mempo), ("grpo", "GRPO (alpha=0)")):
        rows = read_metrics(out / name / "metrics.jsonl")
        steps = [r["step"] for r in rows]
        for ax, key in zip(axes[:2], ("correct_rate", "p_mem_mean"), strict=True):
            values = [float(r.get(key) or 0.0) for r in rows]
            ax.plot(steps, moving_average(values, 5), label=label)
    axes[0].set(title="Training EM (rollouts, 5-step mean)", xlabel="step")
    axes[1].set(title="Training P_mem (5-step mean)", xlabel="step")
    names = ["sft", "mempo", "grpo"]
    axes[2].bar(names, [evals[n]["memory"]["em"] for n in names], color=["grey", "C0", "C1"])
    axes[2].set(title="Held-out EM (memory mode, greedy)", ylim=(0, 1))
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curves.png")
    plt.close(fig)
    return out / "curves.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/learning-curve"))
    parser.add_argument("--preset", choices=sorted(PRESETS), default="reader")
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--sft-tasks", type=int, default=128, help="oracle tasks per number of questions and world")
    parser.add_argument("--sft-mode", default="memory", choices=["memory", "both"],
                        help="both: the policy also learns full mode, so full-mode tokens compare like with like")
    parser.add_argument("--sft-worlds", type=int, default=8, help="worlds of the SFT data (seeds 0, 1, ...)")
    parser.add_argument("--rl-steps", type=int, default=60)
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--questions", default="1-2", help="questions per task, training and eval")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=4)
    parser.add_argument("--eval-tasks", type=int, default=30, help="held-out tasks per number of questions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mem-min-std", type=float, default=MEM_MIN_STD,
                        help="memory-advantage pools with a smaller std get none (0: only zero-variance ones)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[learning-curve] %(message)s")  # pretraining progress
    lo, _, hi = args.questions.partition("-")
    args.ks = ",".join(str(k) for k in range(int(lo), int(hi or lo) + 1))
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    sft = args.out / "sft"
    if not (sft / "model.safetensors").exists():
        base = ensure_tiny(default_cache_dir(), PRESETS[args.preset])
        run("sft", ["sft", "--model", str(base), "--out", str(sft), "--k", args.questions,
                    "--tasks", str(args.sft_tasks), "--worlds", str(args.sft_worlds), "--mode", args.sft_mode, "--steps", str(args.sft_steps), "--seed", str(args.seed)])  # fmt: skip
    evals = {"sft": evaluate(sft, args.out / "eval-sft", args)}
    minutes = {}
    for name, alpha in (("mempo", 1.0), ("grpo", 0.0)):
        weights, minutes[name] = train(name, sft, alpha, args)
        evals[name] = evaluate(weights, args.out / f"eval-{name}", args)

    summary = {
        "sft_em": evals["sft"]["memory"]["em"],
        "mempo_em": evals["mempo"]["memory"]["em"],
        "grpo_em": evals["grpo"]["memory"]["em"],
        "sft_p_mem": evals["sft"]["memory"].get("p_mem"),
        "mempo_p_mem": evals["mempo"]["memory"].get("p_mem"),
        "grpo_p_mem": evals["grpo"]["memory"].get("p_mem"),
        "mempo_tokens_per_task": evals["mempo"]["memory"]["tokens_per_task"],
        "full_mode_tokens_per_task": evals["mempo"]["full"]["tokens_per_task"],
        "minutes": round(minutes["mempo"], 1),
        "grpo_minutes": round(minutes["grpo"], 1),
        "total_minutes": round((time.monotonic() - started) / 60, 1),
        "sft_format_rate": evals["sft"]["memory"]["format_rate"],
        "mempo_f1": evals["mempo"]["memory"]["f1"],
        "grpo_f1": evals["grpo"]["memory"]["f1"],
        "sft_f1": evals["sft"]["memory"]["f1"],
        "rl_steps": args.rl_steps,
        "mem_min_std": args.mem_min_std,
        "ks": args.ks,
        "eval_tasks": args.eval_tasks,
        "curves": str(plot(args.out, evals, args.mem_min_std)),
    }
    (args.out / "summary.json").write_text(json.dumps({**summary, "evals": evals}, indent=1))
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}))


if __name__ == "__main__":
    main()
