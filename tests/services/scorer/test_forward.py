"""Plans reproduce agent_format's contexts; prefix-shared log-probs equal the naive ones."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mempo import agent_format as fmt
from mempo.api.scorer import ChatMessage, ScoreItem
from mempo_sim.world import World
from services.scorer.forward import (
    MIN_FILL,
    _passes,
    naive_logprobs,
    score_rows,
    shared_logprobs,
    sub_batches,
)
from services.scorer.model import LoadedModel
from services.scorer.plan import Plan, Row, memory_results, plan_item, plan_memory

from .conftest import random_trajectory


def test_plan_rebuilds_agent_format_contexts(loaded: LoadedModel, world: World) -> None:
    tok = loaded.tokenizer
    rng = random.Random(0)
    for _ in range(6):
        traj = random_trajectory(rng, world, rng.randint(1, 8))
        plan = Plan()
        plan_memory(plan, tok, traj, "best")
        row, entry = plan.rows[0], plan.memory[0]
        assert entry.candidates == fmt.answer_candidates(traj.answers, "best")
        transcripts = [r.transcript for r in traj.rounds]
        for t, r in enumerate(traj.rounds):
            full_ctx = fmt.full_scoring_ids(tok, traj.questions, transcripts[:t])
            for c, target in enumerate(entry.full[t]):
                assert row.context_of(target.segment) == full_ctx
                assert target.context_tokens == len(full_ctx)
                answer = fmt.answer_target_ids(tok, entry.candidates[c])
                assert list(row.segments[target.segment].ids) == answer
            mem = entry.mem[t]
            assert (mem is None) == (r.memory is None)
            if mem is not None and r.memory is not None:
                mem_ctx = fmt.memory_scoring_ids(tok, traj.questions, r.memory)
                assert all(row.context_of(m.segment) == mem_ctx for m in mem)
        # the trunk is the last round's full context without the cue: one prefix for all
        cue = tok.encode(fmt.answer_cue(), add_special_tokens=False)
        assert row.trunk == fmt.full_scoring_ids(tok, traj.questions, transcripts[:-1])[: -len(cue)]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for k in a for x, y in zip(a[k], b[k], strict=True))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_equals_naive_on_random_trajectories(
    loaded: LoadedModel, world: World, seed: int
) -> None:
    rng = random.Random(seed)
    plan = Plan()
    for _ in range(5):
        traj = random_trajectory(rng, world, rng.randint(1, 8))
        plan_memory(plan, loaded.tokenizer, traj, rng.choice(["best", "first"]))
    shared = shared_logprobs(loaded.model, plan.rows, loaded.pad_id)
    naive = naive_logprobs(loaded.model, plan.rows)
    assert _max_diff(shared, naive) < 1e-5
    # and row by row (batch 1: no padding, another trunk length) it is the same
    alone = shared_logprobs(loaded.model, plan.rows[:1], loaded.pad_id)
    assert _max_diff(alone, {k: v for k, v in naive.items() if k[0] == 0}) < 1e-5


def test_both_pass_layouts_are_exercised(loaded: LoadedModel, world: World) -> None:
    """Long trunks split P_mem into a second pass over a cropped cache; short ones do not."""
    rng = random.Random(3)
    for rounds, passes in ((8, 2), (1, 1)):
        plan = Plan()
        plan_memory(plan, loaded.tokenizer, random_trajectory(rng, world, rounds), "best")
        assert len(_passes(plan.rows)) == passes
        shared = shared_logprobs(loaded.model, plan.rows, loaded.pad_id)
        assert _max_diff(shared, naive_logprobs(loaded.model, plan.rows)) < 1e-5


def test_generic_items_shared_equals_naive(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    items = [
        ScoreItem(context="x", answers=["Lorlek Bank", "Lorlek"]),  # one-token context: empty trunk
        ScoreItem(context="Who founded the bank? Answer:", answers=["Mirath"]),
        ScoreItem(
            context=[ChatMessage(role="user", content="Where was Bothi born?")],
            answers=["Dostania", "Mirath", "1840"],
        ),
    ]
    plan = Plan()
    for item in items:
        assert plan_item(plan, tok, item, "best")
    assert len(plan.rows[0].trunk) == 0
    shared = shared_logprobs(loaded.model, plan.rows, loaded.pad_id)
    assert _max_diff(shared, naive_logprobs(loaded.model, plan.rows)) < 1e-5


def test_p_by_hand_with_a_plain_forward(loaded: LoadedModel) -> None:
    """P_full(round 2) and P_mem(round 1) of a two-round task, from agent_format ids."""
    from mempo.api.scorer import MemoryRound, MemoryTrajectory

    tok, model = loaded.tokenizer, loaded.model
    traj = MemoryTrajectory(
        questions=["Where was Bothi born?"],
        answers=[["Dostania"]],
        rounds=[
            MemoryRound(memory="Q1: ?", transcript="<mem>Q1: ?</mem>\n<search>Bothi</search>"),
            MemoryRound(memory="Q1: Dostania", transcript="<answer>Dostania</answer>"),
        ],
    )

    def by_hand(context: list[int]) -> float:
        answer = tok.encode(" Dostania", add_special_tokens=False)  # as written after "<answer>"
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([context + answer])).logits[0]
        logp = torch.log_softmax(logits.double(), -1)
        picked = [float(logp[len(context) - 1 + j, a]) for j, a in enumerate(answer)]
        return math.exp(sum(picked) / len(picked))

    full_2 = by_hand(fmt.full_scoring_ids(tok, traj.questions, [traj.rounds[0].transcript]))
    mem_1 = by_hand(fmt.memory_scoring_ids(tok, traj.questions, "Q1: ?"))
    plan = Plan()
    plan_memory(plan, tok, traj, "best")
    scores = memory_results(plan, shared_logprobs(model, plan.rows, loaded.pad_id))[0].rounds
    assert scores[1].p_full == pytest.approx(full_2, rel=1e-5)
    assert scores[0].p_mem == pytest.approx(mem_1, rel=1e-5)
    assert scores[0].reward == pytest.approx(scores[0].p_mem - scores[0].p_full)


def test_sub_batches_respect_the_budget_and_bound_padding() -> None:
    rows = [Row(trunk=[1] * n) for n in (10, 50, 20, 40, 30, 48, 47, 46, 12)]
    groups = sub_batches(rows, budget=150)
    assert sorted(i for g in groups for i in g) == list(range(len(rows)))
    for g in groups:
        longest = max(rows[i].num_tokens for i in g)
        assert len(g) == 1 or longest * len(g) <= 150
        assert min(rows[i].num_tokens for i in g) >= MIN_FILL * longest
    assert [50, 48, 47] in [[rows[i].num_tokens for i in g] for g in groups]  # budget: 3 x 50


def test_score_rows_in_sub_batches_equals_one_batch(loaded: LoadedModel, world: World) -> None:
    rng = random.Random(5)
    plan = Plan()
    for _ in range(6):
        plan_memory(plan, loaded.tokenizer, random_trajectory(rng, world, rng.randint(1, 8)), "best")
    whole = shared_logprobs(loaded.model, plan.rows, loaded.pad_id)
    split = score_rows(loaded.model, plan.rows, budget=600, pad_id=loaded.pad_id)
    assert len(sub_batches(plan.rows, 600)) > 1
    assert split.keys() == whole.keys()
    for key, values in whole.items():
        assert split[key] == pytest.approx(values, abs=1e-5)
