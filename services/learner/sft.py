"""SFT warm start: next-token loss on response tokens only, then an HF checkpoint.

MemPO's recipe starts RL from an SFT model. The default data are the synthetic world's
oracle trajectories, their prompts built by the rollout worker's own rule
(``mempo.next_prompt.next_prompt_ids``): memory mode with the previous round only, full
mode by appending ids. Sequences come from the same ``trajectory_sequences`` the PPO
trainer uses, so a prompt or an information block is never trained on. A jsonl file of
rendered rounds works too: one round a line, ``{"prompt": str, "response": str}`` or
``{"prompt_ids": [int], "response_ids": [int]}``.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from mempo.agent_format import (
    Tokenizer,
    format_documents,
    mem_token_span,
    memory_prompt_ids,
    parse_response,
)
from mempo.files import atomic_dir
from mempo.next_prompt import next_prompt_ids
from mempo.schedule import cosine_schedule
from mempo.schemas import Round, Trajectory
from mempo.tracking import Tracker
from services.learner.batch import TrainingBatch, TrainSequence, trajectory_sequences
from services.learner.packing import forward_logprobs, micro_batches

log = logging.getLogger(__name__)

SftMode = Literal["memory", "full", "both"]


class SftConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(default=1e-3, gt=0)
    """Peak AdamW learning rate (1e-3 suits the tiny model; 1e-5 for 7B-class models)."""

    steps: int | None = Field(default=None, ge=1)
    """Optimizer steps; None: ``epochs`` passes over the data."""

    epochs: float = Field(default=3.0, gt=0)
    """Passes over the data when ``steps`` is None."""

    batch_sequences: int = Field(default=16, ge=1)
    """Sequences per optimizer step."""

    micro_batch_tokens: int = Field(default=8192, ge=16)
    """Token budget of one forward/backward."""

    row_tokens: int | None = Field(default=512, ge=16)
    """Longest packed row (see TrainerConfig.row_tokens)."""

    warmup_steps: int = Field(default=5, ge=0)
    """Linear warmup steps."""

    final_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """After warmup the learning rate decays along a cosine to ``lr * final_lr_ratio`` at
    the last step (1: constant)."""

    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""

    grad_clip: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""

    copy_weight: float = Field(default=1.0, gt=0)
    """Loss weight of the tokens the agent copies, the contents of its ``<mem>``,
    ``<search>`` and ``<answer>`` blocks, against 1 for every other response token (the
    reading drills weight their answers so: mempo_sim/pretrain.py)."""

    seed: int = 0
    """Seeds the data order and torch."""

    log_every: int = Field(default=10, ge=1)
    """Log loss and tokens/s every this many steps."""


@dataclass(frozen=True)
class SftReport:
    out_dir: Path
    steps: int
    sequences: int
    first_loss: float
    last_loss: float
    tokens_per_s: float


# --------------------------------------------------------------------------- data


def oracle_rounds(
    tok: Tokenizer, questions: Sequence[str], search: Callable[[str], str], oracle: Any, mode: str
) -> list[Round]:
    """The oracle's episode as the rollout worker would record it (ids, mem spans)."""
    memory_mode = mode == "memory"
    prompt = memory_prompt_ids(tok, questions, None)
    rounds: list[Round] = []
    for index, oracle_round in enumerate(oracle.episode(questions, search, mode)):
        response_ids = list(tok.encode(oracle_round.response, add_special_tokens=False))
        text = tok.decode(response_ids, skip_special_tokens=True)
        parsed = parse_response(text, require_memory=memory_mode)
        rounds.append(
            Round.model_validate(
                {
                    "index": index,
                    "prompt_ids": prompt,
                    "response_ids": response_ids,
                    "response_logprobs": [0.0] * len(response_ids),
                    "mem_span": mem_token_span(tok, response_ids, text, parsed.mem_chars),
                    "action": parsed.action,
                    "query": parsed.query,
                    "information": oracle_round.information,
                }
            )
        )
        if parsed.action != "search":
            break
        prompt = next_prompt_ids(tok, questions, rounds[-1], parsed, memory_mode)
    return rounds


def oracle_sequences(
    tok: Tokenizer,
    tasks: int = 64,
    k: int | Sequence[int] = 1,
    mode: SftMode = "memory",
    world_seed: int = 0,
    seed: int = 0,
    worlds: int = 1,
    subjects: bool = False,
) -> list[TrainSequence]:
    """Training sequences of the oracle on ``tasks`` train-split tasks of each number of
    questions in ``k`` (a number given twice: twice as many, other tasks), in each mode, in
    each of ``worlds`` worlds (seeds ``world_seed``, ``world_seed + 1``, ...). Several
    worlds give the same skills with different facts: a policy cannot memorise them and
    must learn to search, read and copy. ``subjects``: the oracle's memory keeps each open
    question's subject (``Q2: Roqua > ?``)."""
    from mempo.bm25 import LocalSearch
    from mempo_sim.oracle import Oracle
    from mempo_sim.world import World, WorldConfig

    modes = ["memory", "full"] if mode == "both" else [mode]
    ks = [k] if isinstance(k, int) else list(k)
    sequences: list[TrainSequence] = []
    for world_index in range(worlds):
        world = World.generate(WorldConfig(seed=world_seed + world_index))
        index = LocalSearch(world.passages)
        oracle = Oracle(world, subjects=subjects)

        def search(query: str, index: LocalSearch = index) -> str:
            return format_documents(index.retrieve([query], 3)[0])

        for m in modes:
            for questions, _ in (
                t
                for i, n in enumerate(ks)
                for t in world.tasks("train", n, tasks, seed=seed + 7919 * ks[:i].count(n))
            ):
                traj = Trajectory(rounds=oracle_rounds(tok, questions, search, oracle, m))
                sequences.extend(trajectory_sequences(traj, full_mode=m == "full"))
    return sequences


def jsonl_sequences(tok: Tokenizer, path: Path) -> list[TrainSequence]:
    """One rendered round a line; raises ValueError naming the line of a bad record."""
    sequences = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "prompt_ids" in row:
                prompt, response = (
                    [int(i) for i in row["prompt_ids"]],
                    [int(i) for i in row["response_ids"]],
                )
            else:
                prompt = tok.encode(str(row["prompt"]), add_special_tokens=False)
                response = tok.encode(str(row["response"]), add_special_tokens=False)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a rendered round ({exc!r})") from exc
        if not prompt or not response:
            raise ValueError(f"{path}:{number}: prompt and response must both be non-empty")
        rnd = Round.model_validate(
            {
                "index": 0,
                "prompt_ids": prompt,
                "response_ids": response,
                "response_logprobs": [0.0] * len(response),
                "action": "answer",
            }
        )
        sequences.extend(trajectory_sequences(Trajectory(rounds=[rnd]), full_mode=False))
    if not sequences:
        raise ValueError(f"{path} holds no rounds")
    return sequences


# --------------------------------------------------------------------------- training


def _runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive positions (one response each)."""
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(positions, breaks) if run.size]


def _find(ids: list[int], pattern: list[int], start: int, end: int) -> int:
    """First index of ``pattern`` in ``ids[start:end]``, or -1."""
    for i in range(start, end - len(pattern) + 1):
        if ids[i : i + len(pattern)] == pattern:
            return i
    return -1


def copy_weights(tok: Tokenizer, sequences: Sequence[TrainSequence], weight: float) -> torch.Tensor:
    """(K,) loss weight of every trained token of ``sequences`` (TrainingBatch order):
    ``weight`` inside the contents of a response's <mem>, <search> and <answer> blocks,
    1 elsewhere."""
    from mempo.agent_format import DEFAULT_TAGS as T

    tags = [
        (
            tok.encode(T.open(name), add_special_tokens=False),
            tok.encode(T.close(name), add_special_tokens=False),
        )
        for name in (T.mem, T.search, T.answer)
    ]
    out = []
    for seq in sequences:
        ids, heavy = seq.input_ids.tolist(), np.zeros(len(seq.input_ids), dtype=bool)
        for start, end in _runs(seq.positions):
            for open_ids, close_ids in tags:
                at = _find(ids, open_ids, start, end)
                while at >= 0:
                    body = at + len(open_ids)
                    close = _find(ids, close_ids, body, end)
                    heavy[body : close if close >= 0 else end] = True
                    at = _find(ids, open_ids, close + len(close_ids), end) if close >= 0 else -1
        out.append(np.where(heavy[seq.positions], weight, 1.0))
    return torch.from_numpy(np.concatenate(out) if out else np.zeros(0)).float()


def _loss(
    model: torch.nn.Module,
    batch: TrainingBatch,
    seqs: list[int],
    config: SftConfig,
    weights: torch.Tensor,
) -> float:
    """Weighted token-mean NLL of ``seqs``' response tokens (``weights``: (K,) of the
    batch), accumulated over micro-batches."""
    total = float(weights[batch.token_index(seqs)].sum())
    device = next(model.parameters()).device
    value = 0.0
    for micro in micro_batches(batch, seqs, config.micro_batch_tokens, config.row_tokens):
        logp, _ = forward_logprobs(model, micro.to(device))
        loss = -(logp * weights[micro.token_index].to(device)).sum() / total
        loss.backward()
        value += float(loss.detach())
    return value


def _batches(num_sequences: int, per_step: int, steps: int, seed: int) -> Iterator[list[int]]:
    """``steps`` batches of sequence indices: epoch-wise shuffles, concatenated."""
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < per_step:
            order.extend(rng.sample(range(num_sequences), num_sequences))
        yield order[:per_step]
        order = order[per_step:]


def _write_policy(model: Any, base_dir: Path, out_dir: Path) -> None:
    """Export aside, then rename: the folder is whole or absent."""
    from services.learner.checkpoint import export_hf, tied_parameter_names

    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    with atomic_dir(out_dir) as tmp:
        export_hf(state, model.config, base_dir, tmp, tied=tied_parameter_names(model))


def _token_weights(model_path: str | Path, sequences: list[TrainSequence], tokens: int, copy_weight: float) -> torch.Tensor:
    """Each trained token's loss weight: 1, or ``copy_weight`` on what the agent copies."""
    if copy_weight == 1.0:
        return torch.ones(tokens)
    from transformers import AutoTokenizer

    return copy_weights(cast(Tokenizer, AutoTokenizer.from_pretrained(model_path)), sequences, copy_weight)


def _report(step: int, steps: int, figures: dict[str, float], tracker: Tracker | None) -> None:
    log.info("sft step %s/%s loss %.4f tokens/s %.0f", step, steps, figures["sft/loss"], figures["perf/throughput"])
    if tracker is not None:
        tracker.log(figures, step)


def train_sft(
    model_path: str | Path,
    sequences: list[TrainSequence],
    out_dir: Path,
    config: SftConfig,
    device: str = "cpu",
    tracker: Tracker | None = None,
) -> SftReport:
    """Fine-tune on ``sequences`` and write an HF checkpoint usable as the policy; every
    ``log_every`` steps the loss to the log and ``tracker``."""
    from transformers import AutoModelForCausalLM

    from services.learner.trainer import seed_everything

    if not sequences:
        raise ValueError("no sequences to train on")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    seed_everything(config.seed)
    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = model.to(device)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay
    )
    batch = TrainingBatch.of(sequences)
    weights = _token_weights(model_path, sequences, batch.num_tokens, config.copy_weight)
    per_step = min(config.batch_sequences, len(sequences))
    steps = config.steps or max(1, math.ceil(config.epochs * len(sequences) / per_step))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_schedule(config.warmup_steps, steps, config.final_lr_ratio)
    )
    losses: list[float] = []
    tokens, started = 0, time.perf_counter()
    for step, seqs in enumerate(_batches(len(sequences), per_step, steps, config.seed), start=1):
        optimizer.zero_grad(set_to_none=True)
        losses.append(_loss(model, batch, seqs, config, weights))
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        tokens += sum(len(sequences[i].input_ids) for i in seqs)
        if step % config.log_every == 0 or step == steps:
            rate = tokens / (time.perf_counter() - started)
            _report(step, steps, {"sft/loss": losses[-1], "actor/lr": float(scheduler.get_last_lr()[0]),
                                  "perf/throughput": rate}, tracker)  # fmt: skip
    _write_policy(model, Path(model_path), out_dir)
    return SftReport(
        out_dir=out_dir,
        steps=steps,
        sequences=len(sequences),
        first_loss=losses[0],
        last_loss=losses[-1],
        tokens_per_s=tokens / (time.perf_counter() - started),
    )
