"""One temperature from the sampling to the learner (issue 14, item 1).

The CPU engine samples at T != 1 over real HTTP and returns SGLang's log-probs,
log_softmax(logits / T); a teacher-forced forward of the same model agrees within 1e-5.
The rollouts travel in a Group that carries T, and the learner's recomputed old
log-probs equal the engine's; the step's ``logprob_gap`` metric (mean |rollout -
recomputed| over the response tokens) shows ~0, and shows a mislabelled T at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from mempo.arrays import LogProbs, TokenIds
from mempo.clients.engine import EngineClient, Generation
from mempo.schemas import Group, Round, Task, Trajectory
from services.learner.batch import build_batch
from services.learner.step import logprobs, train_step
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from services.rollout.engine.inprocess import EngineThread
from tests.services.rollout.test_engine_support import engine_settings, teacher_forced

T = 0.7
PROMPTS = ([5, 17, 42, 8, 99], [3, 1, 4, 1, 5, 9, 2, 6])


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path) -> Iterator[str]:
    with EngineThread(engine_settings(tiny_model_dir)) as base:
        yield base


async def sample(url: str, temperature: float) -> list[Generation]:
    params = {
        "max_new_tokens": 12,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": -1,
        "ignore_eos": True,
        "sampling_seed": 3,
        "n": 1,
    }
    async with EngineClient(url) as engine:
        return [(await engine.generate(p, params))[0] for p in PROMPTS]


def group_of(gens: list[Generation], temperature: float) -> Group:
    task = Task(questions=["q"], answers=[["a"]], n=len(gens))
    trajectories = [
        Trajectory(
            rounds=[
                Round(
                    index=0,
                    prompt_ids=TokenIds(p),
                    response_ids=TokenIds(g.output_ids),
                    response_logprobs=LogProbs(g.logprobs),
                    action="answer",
                )
            ],
            reward=float(i),
        )
        for i, (p, g) in enumerate(zip(PROMPTS, gens, strict=True))
    ]
    return Group(
        group_id=task.group_id,
        task=task,
        trajectories=trajectories,
        policy_version=0,
        temperature=temperature,
    )


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


async def test_engine_logprobs_are_of_logits_over_t(url: str, hf_model: Any) -> None:
    for gen, prompt in zip(await sample(url, T), PROMPTS, strict=True):
        want = teacher_forced(hf_model, prompt + gen.output_ids, T)[len(prompt) - 1 :]
        raw = teacher_forced(hf_model, prompt + gen.output_ids)[len(prompt) - 1 :]
        assert torch.allclose(torch.tensor(gen.logprobs), torch.tensor(want), atol=1e-5)
        assert not torch.allclose(torch.tensor(gen.logprobs), torch.tensor(raw), atol=1e-2)


async def test_the_learner_recomputes_the_engines_logprobs(url: str, tiny_model_dir: Path) -> None:
    group = group_of(await sample(url, T), T)
    again = Group.model_validate_json(group.model_dump_json(context={"pack": True}))
    assert again.temperature == T  # it travels in the wire record
    trainer = Trainer(TrainerConfig(mini_batches=2, beta_kl=0.0, lr=1e-6), tiny_model_dir)
    batch = build_batch([again])
    recomputed = logprobs(trainer, trainer.policy, batch)
    assert torch.allclose(recomputed, batch.rollout_logprobs, atol=1e-5)
    metrics = train_step(trainer, [again])
    assert metrics["logprob_gap"] < 1e-5  # recomputed before the update: the same numbers

    mislabelled = train_step(trainer, [group_of(await sample(url, T), 1.0)])
    assert mislabelled["logprob_gap"] > 1e-2  # the metric shows a temperature mismatch


async def test_greedy_rollouts_are_recomputed_at_t_1(url: str, tiny_model_dir: Path) -> None:
    group = group_of(await sample(url, 0.0), 0.0)
    assert group.logprob_temperature == 1.0
    trainer = Trainer(TrainerConfig(mini_batches=2, beta_kl=0.0), tiny_model_dir)
    batch = build_batch([group])
    assert torch.allclose(
        logprobs(trainer, trainer.policy, batch), batch.rollout_logprobs, atol=1e-5
    )


def test_old_records_without_a_temperature_stay_valid() -> None:
    task = Task(questions=["q"], answers=[["a"]], n=1)
    rnd = Round(
        index=0,
        prompt_ids=TokenIds([1]),
        response_ids=TokenIds([2]),
        response_logprobs=LogProbs([-0.5]),
        action="answer",
    )
    old = Group(
        group_id=task.group_id, task=task, trajectories=[Trajectory(rounds=[rnd])], policy_version=0
    ).model_dump(mode="json")
    del old["temperature"]
    for record in (old, old["task"], old["trajectories"][0], old["trajectories"][0]["rounds"][0]):
        record["schema_version"] = 1
    parsed = Group.model_validate(old)
    assert parsed.temperature == 1.0 and parsed.schema_version == 1
    with pytest.raises(ValueError, match="schema_version 3"):
        Group.model_validate({**old, "schema_version": 3})
