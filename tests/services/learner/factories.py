"""Groups built from real rollouts of the tiny model, without any service.

A group's trajectories are the world's oracle episode, rendered exactly as the rollout
worker renders it (services/learner/sft.py: oracle_rounds), and variants in which the
tiny model itself generates one round (sampled with transformers: an invalid round that
ends the episode with reward 0). Every response log-prob is the tiny model's own
(teacher-forced forward), minus optional noise standing in for an engine's numerics.
p_mem / p_full are drawn per round with a memory.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import Any

import torch

from mempo.agent_format import format_documents, mem_token_span, parse_response
from mempo.bm25 import LocalSearch
from mempo.schemas import Group, Mode, Round, Task, Trajectory
from mempo_sim.oracle import Oracle
from mempo_sim.world import World
from services.learner.sft import oracle_rounds


@cache
def _model(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def teacher_logprobs(model: Any, prompt: list[int], response: list[int]) -> list[float]:
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1]  # (n, V)
    logp = logits.float().log_softmax(-1).gather(1, torch.tensor(response)[:, None])[:, 0]
    return [min(v, 0.0) for v in logp.tolist()]


@torch.no_grad()
def sampled_response(model: Any, prompt: list[int], max_new_tokens: int, seed: int) -> list[int]:
    torch.manual_seed(seed)
    out = model.generate(
        torch.tensor([prompt]),
        do_sample=True,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
    )
    return [int(t) for t in out[0, len(prompt) :]]


def rollout_group(
    tokenizer: Any,
    model_dir: Path,
    world: World,
    search: LocalSearch,
    mode: Mode = "memory",
    n: int = 4,
    k: int = 1,
    seed: int = 0,
    with_scores: bool = True,
    logprob_noise: float = 0.0,
    policy_version: int = 0,
) -> Group:
    """One task's group: even trajectories are the oracle's, odd ones break at a sampled round."""
    model = _model(str(model_dir))
    rng = random.Random(seed)
    questions, answers = world.tasks("train", k, 1, seed=seed)[0]
    task = Task(questions=questions, answers=answers, n=n, mode=mode)

    def retrieve(query: str) -> str:
        return format_documents(search.retrieve([query], 3)[0])

    oracle = oracle_rounds(tokenizer, questions, retrieve, Oracle(world), mode)
    trajectories = []
    for i in range(n):
        rounds = list(oracle)
        if i % 2:  # the model writes round j itself: the format breaks, the episode ends
            j = (i // 2) % len(rounds)
            broken = _sampled_round(
                tokenizer, model, rounds[j], mode, rng.randint(4, 10), seed * 100 + i
            )
            rounds = [*rounds[:j], broken]
        rounds = [_with_logprobs(model, r, rng, logprob_noise) for r in rounds]
        correct = i % 2 == 0
        with_memory = sum(r.mem_span is not None for r in rounds)
        p_mem = [rng.uniform(0.05, 0.95) for _ in range(with_memory)] if with_scores else []
        p_full = [rng.uniform(0.05, 0.95) for _ in range(with_memory)] if with_scores else []
        trajectories.append(
            Trajectory(
                rounds=rounds,
                answer_text="; ".join(a[0] for a in answers) if correct else None,
                reward=float(correct),
                correct=correct,
                format_ok=correct,
                p_mem=p_mem,
                p_full=p_full,
                num_tokens=sum(len(r.prompt_ids) + len(r.response_ids) for r in rounds),
            )
        )
    return Group(
        group_id=task.group_id, task=task, trajectories=trajectories, policy_version=policy_version
    )


def _sampled_round(
    tokenizer: Any, model: Any, rnd: Round, mode: Mode, length: int, seed: int
) -> Round:
    """Round ``rnd`` with a response the tiny model samples itself (an invalid one)."""
    response = sampled_response(model, rnd.prompt_ids.tolist(), length, seed)
    text = tokenizer.decode(response, skip_special_tokens=True)
    parsed = parse_response(text, require_memory=mode == "memory")
    return Round.model_validate(
        {
            "index": rnd.index,
            "prompt_ids": rnd.prompt_ids.tolist(),
            "response_ids": response,
            "response_logprobs": [0.0] * len(response),
            "mem_span": mem_token_span(tokenizer, response, text, parsed.mem_chars),
            "action": "invalid",
        }
    )


def _with_logprobs(model: Any, rnd: Round, rng: random.Random, noise: float) -> Round:
    logprobs = teacher_logprobs(model, rnd.prompt_ids.tolist(), rnd.response_ids.tolist())
    if noise:
        logprobs = [min(0.0, v + rng.gauss(0.0, noise)) for v in logprobs]
    return Round.model_validate({**rnd.model_dump(), "response_logprobs": logprobs})


def rollout_groups(
    tokenizer: Any, model_dir: Path, world: World, search: LocalSearch, count: int, **kwargs: Any
) -> list[Group]:
    """``count`` groups of different tasks (seeds 0..count-1 offset by ``seed``)."""
    base = kwargs.pop("seed", 0)
    return [
        rollout_group(tokenizer, model_dir, world, search, seed=base + s, **kwargs)
        for s in range(count)
    ]


@cache
def _environment(model_dir: str) -> tuple[Any, World, LocalSearch]:
    from transformers import AutoTokenizer

    from mempo_sim.world import WorldConfig

    world = World.generate(WorldConfig(seed=0))
    return AutoTokenizer.from_pretrained(model_dir), world, LocalSearch(world.passages)


@cache
def _cached_groups(
    model_dir: str, count: int, options: tuple[tuple[str, Any], ...]
) -> tuple[Group, ...]:
    tokenizer, world, search = _environment(model_dir)
    return tuple(rollout_groups(tokenizer, Path(model_dir), world, search, count, **dict(options)))


def cached_groups(model_dir: Path, count: int = 2, **options: Any) -> list[Group]:
    """``rollout_groups`` built once per process for the same arguments (deep copies out)."""
    groups = _cached_groups(str(model_dir), count, tuple(sorted(options.items())))
    return [g.model_copy(deep=True) for g in groups]
