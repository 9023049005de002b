"""Our PPO update vs TRL GRPOTrainer's training step: same tiny model, same sequences.

The batch: ``--groups`` tasks x ``--n`` rollouts (64 rounds by default), each a prompt
shared by its group (150-330 tokens) and a response of its own (100-190 tokens), so
256-512 tokens a round; random token ids, rewards 0/1 per rollout. Generation is
excluded on both sides: TRL gets the same ids through its ``rollout_func`` hook (its
documented way to bring one's own rollouts) and a reward function that looks them up.

Both do one optimizer step on the 64 rounds with the same work: the reference model's
log-probs (beta = 0.001), one forward/backward of the policy with token-level loss and
entropy, AdamW. (TRL skips recomputing old log-probs when the step is fully on-policy;
so does our trainer with ppo_epochs = mini_batches = 1.) TRL pads every micro-batch to its
longest prompt + longest completion; ours packs sequences without padding and projects
only the response positions onto the vocabulary.

Timed: steps after one warm-up step, alternating the two, in one process (same threads).
tok/s counts the batch's real tokens (prompt + response) per step second.

    python benchmarks/learner_vs_trl.py [--steps 3] [--groups 16] [--n 4]
    python benchmarks/learner_vs_trl.py --smoke   # seconds-scale sizes: checks it runs

Prints one JSON line: {"ours_tok_s": ..., "trl_tok_s": ..., "ratio": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch

from mempo.schemas import Group, Round, Task, Trajectory
from mempo_sim.tiny import default_cache_dir, ensure_tiny

MICRO_BATCH_ROUNDS = 8  # TRL's per-device batch; ours gets the same token budget


def make_groups(vocab: int, groups: int, n: int, seed: int) -> list[Group]:
    """Single-round memory-mode groups: one prompt per task, n responses."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(150, 330))]
        task = Task(
            task_id=f"task-{g}", group_id=f"group-{g}", questions=[f"q{g}"], answers=[["a"]], n=n
        )
        trajectories = []
        for i in range(n):
            response = [rng.randrange(10, vocab) for _ in range(rng.randint(100, 190))]
            reward = float((g + i) % 2)
            rnd = Round.model_validate(
                {
                    "index": 0,
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "response_logprobs": [-1.0] * len(response),
                    "mem_span": (1, 1 + len(response) // 3),
                    "action": "answer",
                }
            )
            trajectories.append(
                Trajectory(rounds=[rnd], reward=reward, correct=bool(reward), format_ok=True)
            )
        out.append(
            Group(group_id=task.group_id, task=task, trajectories=trajectories, policy_version=0)
        )
    return out


def batch_tokens(groups: list[Group]) -> int:
    return sum(
        len(r.prompt_ids) + len(r.response_ids)
        for g in groups
        for t in g.trajectories
        for r in t.rounds
    )


# --------------------------------------------------------------------------- ours


def ours(model_dir: Path, groups: list[Group]) -> Any:
    from services.learner.step import train_step
    from services.learner.trainer import Trainer
    from services.learner.trainer_config import TrainerConfig

    longest = max(
        len(r.prompt_ids) + len(r.response_ids)
        for g in groups
        for t in g.trajectories
        for r in t.rounds
    )
    config = TrainerConfig(
        lr=1e-4,
        warmup_steps=0,
        mini_batches=1,
        ppo_epochs=1,
        beta_kl=0.001,
        micro_batch_tokens=MICRO_BATCH_ROUNDS * longest,
        row_tokens=longest,  # one round a row: the default (512) for these 256-512 token rounds
    )
    trainer = Trainer(config, model_dir)

    def step() -> float:
        started = time.perf_counter()
        train_step(trainer, groups)
        return time.perf_counter() - started

    return step


# --------------------------------------------------------------------------- TRL


class FixedRollouts:
    """TRL's ``rollout_func`` and reward function over our groups (no generation)."""

    def __init__(self, groups: list[Group]) -> None:
        self.by_prompt = {g.task.questions[0]: g for g in groups}
        self.rewards = {
            tuple(t.rounds[0].response_ids.tolist()): t.reward
            for g in groups
            for t in g.trajectories
        }

    def rollout(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        """Each prompt comes n times in a row: hand out its n rounds in order."""
        handed: dict[str, int] = {}
        prompt_ids, completion_ids = [], []
        for prompt in prompts:
            i = handed.get(prompt, 0)
            handed[prompt] = i + 1
            rnd = self.by_prompt[prompt].trajectories[i].rounds[0]
            prompt_ids.append(rnd.prompt_ids.tolist())
            completion_ids.append(rnd.response_ids.tolist())
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}

    def reward(
        self, prompts: list[str], completions: list[str], completion_ids: list[list[int]], **_: Any
    ) -> list[float]:
        return [self.rewards[tuple(ids)] for ids in completion_ids]


def trl(model_dir: Path, groups: list[Group], workdir: Path) -> Any:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.started = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.times.append(time.perf_counter() - self.started)

    n = groups[0].task.n
    config = GRPOConfig(
        output_dir=str(workdir),
        per_device_train_batch_size=MICRO_BATCH_ROUNDS,
        gradient_accumulation_steps=len(groups) * n // MICRO_BATCH_ROUNDS,
        num_generations=n,
        max_completion_length=512,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        beta=0.001,
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=10**6,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        max_steps=1,
    )
    fixed, timer = FixedRollouts(groups), StepTimer()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=fixed.reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": [g.task.questions[0] for g in groups]}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        rollout_func=fixed.rollout,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)  # no log lines: the JSON line is the output

    def step() -> float:
        trainer.train()  # max_steps = 1: one optimizer step on the whole batch
        return timer.times[-1]

    return step


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side")
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="rollouts per group")
    parser.add_argument(
        "--model", type=Path, default=None, help="HF folder (default: the tiny model)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: checks it runs, proves nothing")
    args = parser.parse_args()
    if args.smoke:  # 2 groups x 4 = 8 rounds: one TRL micro-batch; one timed step a side
        args.steps, args.groups, args.n = 1, 2, 4
    model_dir = args.model or ensure_tiny(default_cache_dir())
    from transformers import AutoConfig

    groups = make_groups(
        AutoConfig.from_pretrained(model_dir).vocab_size, args.groups, args.n, seed=0
    )
    tokens = batch_tokens(groups)
    with tempfile.TemporaryDirectory() as workdir:
        sides = {"ours": ours(model_dir, groups), "trl": trl(model_dir, groups, Path(workdir))}
        for step in sides.values():
            step()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.steps):
            for name, step in sides.items():
                times[name].append(step())
    ours_tok_s = tokens / statistics.median(times["ours"])
    trl_tok_s = tokens / statistics.median(times["trl"])
    print(
        json.dumps(
            {
                "ours_tok_s": round(ours_tok_s, 1),
                "trl_tok_s": round(trl_tok_s, 1),
                "ratio": round(ours_tok_s / trl_tok_s, 3),
                "rounds": len(groups) * args.n,
                "tokens": tokens,
                "ours_step_s": [round(t, 3) for t in times["ours"]],
                "trl_step_s": [round(t, 3) for t in times["trl"]],
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
