"""Learning proof over seeds: held-out EM before and after RL, MemPO against GRPO, at k = 1 and 2.

For each seed s of ``--seed-base`` .. ``--seed-base + --seeds - 1``, through the real
commands and services:

1. SFT warm start (``mempo sft``) of the tiny ``reader`` policy on oracle trajectories of
   the seed's 8 worlds (the agent's world ``AGENT_WORLDS + 8 s`` and the next 7; train
   split only); data order seed s. The recipe (``RECIPE``, issue 39): 2,000 steps on
   256 tasks of 1 question and twice 256 of 2 (``--sft-k 1,2,2``), memory mode
   (``--sft-mode both`` adds full mode; it needs about twice the steps);
2. eval of the SFT policy (``mempo eval``) on the agent world's held-out test split
   (entities training never asks about), k = 1 and 2 (``--ks``), memory and full mode,
   P_mem scored, failure kinds counted, memory-mode episodes replayed with the full
   history (what they would cost without the memory);
3. for each arm, ``mempo up`` from the SFT policy (``--rl-steps`` steps of 1- and
   2-question tasks, ``--rl-questions``, with partial credit, ``--reward fraction``; the
   learning rate decays along a cosine to a tenth, ``--no-lr-decay`` keeps it; sampling
   seed s) and eval of its last weights. Arms: ``mempo`` (memory advantage, alpha 1),
   ``grpo`` (alpha 0: plain GRPO, the same ``<mem>`` format), ``span`` (MemPO with
   ``--mem-loss span-mean``: each ``<mem>`` span's loss averaged over its own tokens,
   FoldAct), ``mempo-a03`` and ``mempo-a01`` (alpha 0.3 and 0.1). Default:
   ``mempo-a01,grpo``. An arm added later runs alone on the next call.

Every phase is skipped when its output exists (rerun the same command to resume), and
each one's progress is printed to stderr. Prints one JSON line: means over seeds of
``sft_em``, ``mempo_em``, ``grpo_em`` (memory mode, k = 1), ``sft_p_mem``,
``mempo_p_mem``, ``grpo_p_mem``, ``mempo_tokens_per_task`` and
``full_mode_tokens_per_task`` (k = 1; the MemPO arm, ``mempo_arm``, is the first of
``--arms`` that is not grpo); at k = 2 ``sft_em_k2``, ``grpo_em_k2``, ``mempo_em_k2``,
``sft_format_k2`` and per policy ``<name>_tokens_per_task_k2``, ``<name>_peak_tokens_k2``,
their full-history replays ``<name>_full_history_tokens_per_task_k2`` and
``<name>_full_history_peak_tokens_k2``, and ``<name>_full_peak_tokens_k2`` (the policy
run in full mode); ``minutes`` (one seed's whole run), then ``goals`` (issue 39's
targets), ``spread`` (standard deviation over seeds) and ``per_seed`` (every figure of a
larger k with a ``_k<k>`` suffix, full mode's with ``full_mode_``, the failure kinds);
``summary.json`` and ``curves.png`` in ``--out``. docs/results.md reads the numbers.

    python benchmarks/learning_curve.py --seeds 3 --seed-base 8000 [--out runs/learning-curve]
    python benchmarks/learning_curve.py --smoke   # seconds-scale sizes: checks it runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mempo_cli.launcher.plots import moving_average, read_metrics
from mempo_cli.launcher.warmstart import WarmStart, sft_command
from mempo_sim.pretrain import FIRST_WORLD
from mempo_sim.tiny import PRESETS, default_cache_dir, ensure_tiny

MEMPO = [sys.executable, "-m", "mempo_cli"]
# Seed s plays in world AGENT_WORLDS + 8 s; its SFT also reads the next 7. Far from the
# pretraining worlds (FIRST_WORLD, +1, ...: the reader has read their facts).
AGENT_WORLDS = 100_000
assert FIRST_WORLD + max(p.pretrain_worlds for p in PRESETS.values()) < AGENT_WORLDS
ARMS = {  # what tells the arms apart; the task mix (--rl-questions) and reward are shared
    "mempo": ["--alpha", "1"],
    "grpo": ["--alpha", "0"],
    "span": ["--alpha", "1", "--mem-loss", "span-mean"],  # FoldAct's per-span loss
    "mempo-a03": ["--alpha", "0.3"],  # a smaller memory advantage weight
    "mempo-a01": ["--alpha", "0.1"],  # smaller still
    # How a memory earns its credit (docs/trainer.md): the 2026 variants, at alpha 1
    "mempo-none-success": ["--alpha", "1", "--mem-baseline", "none", "--mem-gate", "success"],  # InfoMem
    "mempo-prev": ["--alpha", "1", "--mem-baseline", "prev"],  # HiMPO
    "mempo-centred": ["--alpha", "1", "--mem-norm", "centred"],  # Dr.GRPO on the memory term
    "mempo-round": ["--alpha", "1", "--mem-norm", "round"],
}
# Figures of every k > 1 in a seed's row: {policy}_{mode tag}{name}_k{k}.
K_FIGURES = {"em": "em", "f1": "f1", "format_rate": "format", "tokens_per_task": "tokens_per_task",
             "peak_tokens": "peak_tokens", "peak_tokens_mean": "peak_tokens_mean", "p_mem": "p_mem"}  # fmt: skip
HISTORY_FIGURES = ("full_history_tokens_per_task", "full_history_peak_tokens")  # mempo_cli/launcher/evaluate.py


# The recommended recipe (docs/results.md, issue 39): SFT on oracle trajectories of 1- and
# 2-question tasks, longer than the demo's warm start; RL on the same mix with partial credit.
RECIPE = {"steps": 2000, "k": "1,2,2", "tasks": 256, "copy_weight": 1.0}
DEFAULT_ARMS = ("mempo-a01", "grpo")

# Step metrics of the learner (docs/trainer.md) averaged over each RL run.
DIAGNOSTICS = ("mem_pool_silenced_frac", "mem_adv_agreement", "mem_reward_outcome_corr")


def log(message: str) -> None:
    print(f"[learning-curve] {message}", file=sys.stderr, flush=True)


def run(argv: list[str]) -> None:
    """One command, its output passed to stderr (the JSON line is this script's stdout)."""
    log(" ".join(argv[2:] if argv[:2] == MEMPO[:2] else argv))
    subprocess.run(argv, check=True, stdout=sys.stderr)


def timed(phase: Path, build: Any) -> float:
    """Run ``build()`` unless ``phase/done.json`` exists; returns the phase's minutes."""
    done = phase / "done.json"
    if not done.exists():
        started = time.monotonic()
        build()
        phase.mkdir(parents=True, exist_ok=True)
        done.write_text(json.dumps({"minutes": (time.monotonic() - started) / 60}))
    return float(json.loads(done.read_text())["minutes"])


def sft(folder: Path, spec: WarmStart, preset: str) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    run(sft_command(spec, ensure_tiny(default_cache_dir(), PRESETS[preset]), tmp))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def evaluate(model: Path, out: Path, world: int, args: argparse.Namespace) -> None:
    run([*MEMPO, "eval", "--model", str(model), "--ks", args.ks, "--tasks", str(args.eval_tasks),
         "--modes", "memory,full", "--score", "--world-seed", str(world), "--transcripts", "4", "--out", str(out)])  # fmt: skip


def figures(out: Path) -> dict[str, dict[str, dict[str, float]]]:
    """{mode: {k: {em, f1, p_mem, tokens_per_task, ...}}} of one eval."""
    return json.loads((out / "eval.json").read_text())["results"]


def failures(out: Path, k: str) -> dict[str, int] | None:
    """How the memory-mode episodes of one eval went wrong (mempo_cli/launcher/transcripts.py)."""
    return json.loads((out / "eval.json").read_text()).get("failures", {}).get("memory", {}).get(k)


def train(folder: Path, sft_model: Path, arm: str, seed: int, world: int, args: argparse.Namespace) -> None:
    shutil.rmtree(folder, ignore_errors=True)  # a run cut short starts again
    run([*MEMPO, "up", "--model", str(sft_model), "--name", folder.name, "--runs-root", str(folder.parent),
         "--steps", str(args.rl_steps), *ARMS[arm], "--questions", args.rl_questions, "--reward", args.reward,
         "--group-size", str(args.group_size),
         "--batch-groups", str(args.batch_groups), "--seed", str(seed), "--world-seed", str(world),
         "--lr-decay-steps", str(args.rl_steps if args.lr_decay else 0), "--no-heldout"])  # fmt: skip


def last_weights(run_dir: Path) -> Path:
    versions = [int(p.name[1:]) for p in (run_dir / "weights").glob("v*") if p.name[1:].isdigit()]
    return run_dir / "weights" / f"v{max(versions)}"


def one_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every phase of one seed; its figures."""
    world = AGENT_WORLDS + 8 * seed
    folder = args.out / f"seed-{seed}"
    spec = replace(WarmStart(), world_seed=world, seed=seed, mode=args.sft_mode, **args.sft_overrides)
    minutes = {"sft": timed(folder / "sft", lambda: sft(folder / "sft", spec, args.preset))}
    minutes["eval-sft"] = timed(folder / "eval-sft", lambda: evaluate(folder / "sft", folder / "eval-sft", world, args))
    evals = {"sft": figures(folder / "eval-sft")}
    for arm in args.arms:
        log(f"seed {seed}: {arm} RL ({args.rl_steps} steps)")
        minutes[arm] = timed(folder / f"{arm}-done", lambda a=arm: train(folder / a, folder / "sft", a, seed, world, args))
        model = last_weights(folder / arm)
        minutes[f"eval-{arm}"] = timed(folder / f"eval-{arm}", lambda m=model, a=arm: evaluate(m, folder / f"eval-{a}", world, args))  # fmt: skip
        evals[arm] = figures(folder / f"eval-{arm}")
    k1 = "1"
    row: dict[str, Any] = {"seed": seed, "world": world, "minutes": sum(minutes.values())}
    for name, ev in evals.items():
        row[f"{name}_em"] = ev["memory"][k1]["em"]
        row[f"{name}_f1"] = ev["memory"][k1]["f1"]
        row[f"{name}_p_mem"] = ev["memory"][k1].get("p_mem")
        row[f"{name}_p_full"] = ev["memory"][k1].get("p_full")
        row[f"{name}_tokens_per_task"] = ev["memory"][k1]["tokens_per_task"]
        row[f"{name}_full_mode_tokens_per_task"] = ev["full"][k1]["tokens_per_task"]
        row[f"{name}_full_mode_em"] = ev["full"][k1]["em"]
        row[f"{name}_format"] = ev["memory"][k1]["format_rate"]
        for k in args.ks.split(",")[1:]:
            for mode, tag in (("memory", ""), ("full", "full_mode_")):
                for figure, short in K_FIGURES.items():
                    row[f"{name}_{tag}{short}_k{k}"] = ev[mode][k].get(figure)
            for figure in HISTORY_FIGURES:  # the memory-mode episodes replayed with the full history
                row[f"{name}_{figure}_k{k}"] = ev["memory"][k].get(figure)
            row[f"{name}_failures_k{k}"] = failures(folder / f"eval-{name}", k)
        rl = folder / name / "metrics.jsonl"
        if rl.exists():
            steps = read_metrics(rl)
            rewards = [float(r.get("reward_mean") or 0.0) for r in steps]
            quarter = max(1, len(rewards) // 4)
            row[f"{name}_reward_change"] = statistics.fmean(rewards[-quarter:]) - statistics.fmean(rewards[:quarter])
            for key in DIAGNOSTICS:  # does the memory advantage agree with the outcome? (step means)
                values = [float(r[key]) for r in steps if r.get(key) is not None]
                if values:
                    row[f"{name}_{key}"] = statistics.fmean(values)
    log(f"seed {seed} done: " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    return row


def summarise(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Means and standard deviations over seeds of every number the seeds share."""
    keys = dict.fromkeys(k for r in rows for k, v in r.items() if isinstance(v, (int, float)) and k not in ("seed", "world"))
    means, spread = {}, {}
    for key in keys:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            means[key] = statistics.fmean(values)
            spread[key] = statistics.stdev(values) if len(values) > 1 else 0.0
    return means, spread


def plot(out: Path, rows: list[dict[str, Any]], arms: list[str]) -> Path:
    """Training reward and P_mem against step (mean over seeds, band: min-max), and
    held-out EM per policy (each seed a dot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8), dpi=110)
    for i, arm in enumerate(arms):
        runs = [read_metrics(out / f"seed-{r['seed']}" / arm / "metrics.jsonl") for r in rows]
        for ax, key in zip(axes[:3], ("reward_mean", "p_mem_mean", "tokens_per_trajectory"), strict=True):
            series = [moving_average([float(m.get(key) or 0.0) for m in metrics], 5) for metrics in runs]
            steps = min(len(s) for s in series)
            if not steps:
                continue
            by_step = [[s[j] for s in series] for j in range(steps)]
            xs = range(1, steps + 1)
            ax.plot(xs, [statistics.fmean(v) for v in by_step], color=f"C{i}", label=arm)
            ax.fill_between(xs, [min(v) for v in by_step], [max(v) for v in by_step], color=f"C{i}", alpha=0.2)
    for ax, title in zip(axes[:3], ("training reward", "training P_mem", "tokens per trajectory"), strict=True):
        ax.set(title=f"{title} (5-step mean; band: seeds' range)", xlabel="RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    names = ["sft", *arms]
    ks = [k for k in ("", "_k2") if all(isinstance(r.get(f"sft_em{k}"), (int, float)) for r in rows)]
    width = 0.8 / len(ks)
    for j, k in enumerate(ks):
        for i, name in enumerate(names):
            values = [r[f"{name}_em{k}"] for r in rows]
            x = i + (j - (len(ks) - 1) / 2) * width
            axes[3].bar(x, statistics.fmean(values), width=width, color="grey" if name == "sft" else f"C{i - 1}",
                        alpha=0.6 if j == 0 else 0.3, hatch="" if j == 0 else "//",
                        label=("k = 1" if j == 0 else "k = 2") if i == 0 else None)  # fmt: skip
            axes[3].scatter([x] * len(values), values, color="black", s=12, zorder=3)
    axes[3].set_xticks(range(len(names)), names)
    axes[3].legend(fontsize=8)
    axes[3].set(title="held-out EM (memory mode, greedy)", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(out / "curves.png")
    plt.close(fig)
    return out / "curves.png"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1, help="how many seeds")
    parser.add_argument("--seed-base", type=int, default=0, help="the first seed")
    parser.add_argument("--out", type=Path, default=Path("runs/learning-curve"))
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"RL arms, from {','.join(ARMS)}")
    parser.add_argument("--sft-mode", default="memory", choices=["memory", "both"],
                        help="both: the policy also learns full mode (full-mode tokens compare like with like; "
                             "it needs about twice the steps)")
    parser.add_argument("--sft-steps", type=int, default=RECIPE["steps"], help="SFT optimizer steps")
    parser.add_argument("--sft-k", default=RECIPE["k"], help="questions per SFT task")
    parser.add_argument("--sft-tasks", type=int, default=RECIPE["tasks"], help="SFT oracle tasks per world and k")
    parser.add_argument("--sft-copy-weight", type=float, default=RECIPE["copy_weight"],
                        help="SFT loss weight of the copied values (mem, search, answer contents)")
    parser.add_argument("--rl-steps", type=int, default=60)
    parser.add_argument("--rl-questions", default="1,2", help="questions per RL task (mempo up --questions)")
    parser.add_argument("--reward", default="fraction", choices=["em", "fraction", "f1"], help="RL outcome reward")
    parser.add_argument("--lr-decay", action=argparse.BooleanOptionalAction, default=True,
                        help="RL's learning rate decays along a cosine to a tenth over --rl-steps")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch-groups", type=int, default=8)
    parser.add_argument("--ks", default="1,2", help="questions per task of the held-out eval (starting with 1)")
    parser.add_argument("--eval-tasks", type=int, default=50, help="held-out tasks per k")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (random-weight model, 1 RL step): runs, proves nothing")
    args = parser.parse_args()
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if args.seeds < 1 or not args.arms or set(args.arms) - set(ARMS) or args.ks.split(",")[0] != "1":
        parser.error(f"--seeds must be >= 1, --arms from {sorted(ARMS)}, --ks must start with 1")
    if args.seed_base < 0:
        parser.error("--seed-base must be >= 0")
    args.preset = "reader"
    args.sft_overrides = {"steps": args.sft_steps, "k": args.sft_k, "tasks": args.sft_tasks,
                          "copy_weight": args.sft_copy_weight}  # fmt: skip
    if args.smoke:
        args.preset, args.sft_overrides = "test", {"steps": 2, "tasks": 2, "worlds": 1, "k": "1,2"}
        args.rl_steps, args.group_size, args.batch_groups, args.ks, args.eval_tasks = 1, 2, 1, "1,2", 1
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    rows = []
    for n, seed in enumerate(range(args.seed_base, args.seed_base + args.seeds), start=1):
        log(f"seed {seed} ({n} of {args.seeds}) in {args.out / f'seed-{seed}'}")
        rows.append(one_seed(seed, args))
    means, spread = summarise(rows)
    mempo_arm = next((a for a in args.arms if a != "grpo"), "mempo")  # the MemPO arm the mempo_* keys report
    summary = {
        **{name: means.get(key) for name, key in headline(mempo_arm, args.arms, args.ks).items()},
        "goals": goals(means, mempo_arm),
        "mempo_arm": mempo_arm, "seeds": [r["seed"] for r in rows], "arms": args.arms, "rl_steps": args.rl_steps, "ks": args.ks,
        "lr_decay": args.lr_decay, "rl_questions": args.rl_questions, "reward": args.reward,
        "sft": args.sft_overrides, "sft_mode": args.sft_mode,
        "eval_tasks": args.eval_tasks, "means": means, "spread": spread, "per_seed": rows,
        "curves": str(plot(args.out, rows, args.arms)),
    }  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, default=lambda v: v, separators=(",", ":")))


def headline(mempo_arm: str, arms: list[str], ks: str) -> dict[str, str]:
    """The issue's names -> the figures every seed row holds (``mempo_arm`` the MemPO arm
    the mempo_* names report; the k = 2 figures only when ``ks`` holds 2)."""
    names = {
        "sft_em": "sft_em", "mempo_em": f"{mempo_arm}_em", "grpo_em": "grpo_em",
        "sft_p_mem": "sft_p_mem", "mempo_p_mem": f"{mempo_arm}_p_mem", "grpo_p_mem": "grpo_p_mem",
        "mempo_tokens_per_task": f"{mempo_arm}_tokens_per_task",
        "full_mode_tokens_per_task": f"{mempo_arm}_full_mode_tokens_per_task", "minutes": "minutes",
    }
    if "2" in ks.split(","):  # memory mode at k = 2, and the peak context in both modes
        names |= {"sft_em_k2": "sft_em_k2", "grpo_em_k2": "grpo_em_k2", "mempo_em_k2": f"{mempo_arm}_em_k2",
                  "sft_format_k2": "sft_format_k2"}  # fmt: skip
        for name in ("sft", *arms):
            for key in ("peak_tokens_k2", "tokens_per_task_k2", *(f"{f}_k2" for f in HISTORY_FIGURES)):
                names[f"{name}_{key}"] = f"{name}_{key}"
            names[f"{name}_full_peak_tokens_k2"] = f"{name}_full_mode_peak_tokens_k2"
    return names


def goals(means: dict[str, float], arm: str) -> dict[str, bool | None]:
    """The issue's targets on the means over seeds (None: a figure is missing): the SFT
    policy learns k = 2 and keeps k = 1; RL adds 0.10 at k = 2 and keeps k = 1; the RL
    policy's memory-mode episodes at k = 2 cost fewer tokens than the same episodes with
    the full history in context (the replay of ``mempo eval``: a policy SFT-trained in
    memory mode only does not play full mode, its full-mode figures are reported beside),
    their peak context at most 0.6x; one seed within 45 minutes."""

    def at_least(key: str, bound: float | str, margin: float = 0.0) -> bool | None:
        floor = means.get(bound) if isinstance(bound, str) else bound
        return None if means.get(key) is None or floor is None else means[key] >= floor + margin - 1e-9

    def ratio_at_most(a: str, b: str, bound: float) -> bool | None:
        return None if means.get(a) is None or not means.get(b) else means[a] <= bound * means[b]

    return {
        "sft_k2_em_at_least_0.25": at_least("sft_em_k2", 0.25),
        "sft_k2_format_at_least_0.90": at_least("sft_format_k2", 0.90),
        "sft_k1_em_at_least_0.30": at_least("sft_em", 0.30),
        "k2_em_mempo_over_sft_by_0.10": at_least(f"{arm}_em_k2", "sft_em_k2", 0.10),
        "k2_em_grpo_over_sft_by_0.10": at_least("grpo_em_k2", "sft_em_k2", 0.10),
        "k1_em_mempo_at_least_0.45": at_least(f"{arm}_em", 0.45),
        "k2_tokens_memory_below_full_history_mempo": ratio_at_most(f"{arm}_tokens_per_task_k2", f"{arm}_full_history_tokens_per_task_k2", 1.0 - 1e-9),
        "k2_peak_memory_at_most_0.6_full_history_mempo": ratio_at_most(f"{arm}_peak_tokens_k2", f"{arm}_full_history_peak_tokens_k2", 0.6),
        "minutes_at_most_45": None if means.get("minutes") is None else means["minutes"] <= 45,
    }  # fmt: skip


if __name__ == "__main__":
    main()
