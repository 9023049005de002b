"""SFT warm start (services/learner/sft.py) and the ``mempo sft`` command."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from mempo.agent_format import (
    PreviousRound,
    format_documents,
    information_ids,
    memory_prompt_ids,
    parse_response,
)
from mempo.bm25 import LocalSearch
from mempo.schemas import Task
from mempo_sim.oracle import Oracle
from mempo_sim.world import World
from services.learner.batch import TrainingBatch, TrainSequence
from services.learner.packing import forward_logprobs, micro_batches
from services.learner.sft import (
    SftConfig,
    copy_weights,
    jsonl_sequences,
    oracle_rounds,
    oracle_sequences,
    train_sft,
)
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from tests.services.rollout.scripted import ScriptedEngine, booted_worker


@pytest.mark.parametrize("mode", ["memory", "full"])
def test_oracle_rounds_are_rendered_like_the_rollout_worker(
    tokenizer: object, world: World, local_search: LocalSearch, mode: str
) -> None:
    tok = tokenizer
    questions, _ = world.tasks("train", 2, 1, seed=3)[0]
    rounds = oracle_rounds(
        tok,
        questions,
        lambda q: format_documents(local_search.retrieve([q], 3)[0]),
        Oracle(world),
        mode,  # type: ignore[arg-type]
    )
    assert len(rounds) > 2 and rounds[-1].action == "answer"
    assert rounds[0].prompt_ids == memory_prompt_ids(tok, questions, None)  # type: ignore[arg-type]
    for prev, nxt in itertools.pairwise(rounds):
        text = tok.decode(prev.response_ids.tolist(), skip_special_tokens=True)  # type: ignore[attr-defined]
        parsed = parse_response(text, require_memory=mode == "memory")
        assert prev.action == "search" and prev.query == parsed.query
        if mode == "memory":
            previous = PreviousRound(parsed.memory or "", parsed.query, prev.information or "")
            assert nxt.prompt_ids == memory_prompt_ids(tok, questions, previous)  # type: ignore[arg-type]
            start, end = prev.mem_span or (0, 0)
            memory = tok.decode(prev.response_ids.tolist()[start:end], skip_special_tokens=True)  # type: ignore[attr-defined]
            assert memory.strip() == (parsed.memory or "").strip()
        else:
            info = information_ids(tok, prev.information or "")  # type: ignore[arg-type]
            assert nxt.prompt_ids == [*prev.prompt_ids, *prev.response_ids, *info]


def _rounds_of(sequence: TrainSequence) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) ids of each round a training sequence holds: a response is a run
    of trained positions, its prompt every id before it."""
    ids, positions = sequence.input_ids.tolist(), sequence.positions
    breaks = [0, *(np.flatnonzero(np.diff(positions) != 1) + 1).tolist(), len(positions)]
    return [
        (ids[: positions[a]], ids[positions[a] : positions[b - 1] + 1])
        for a, b in itertools.pairwise(breaks)
    ]


@pytest.mark.parametrize("mode", ["memory", "full"])
async def test_sft_rounds_are_the_prompts_a_rollout_shows_on_the_oracle_path(
    tokenizer: Any, world: World, local_search: LocalSearch, mode: str
) -> None:
    """The rollout worker's episode loop, its engine answering as the oracle, shows round by
    round the prompts SFT trains on (``world`` is oracle_sequences' default world)."""
    sequences = oracle_sequences(tokenizer, tasks=2, k=[1, 2], mode=mode)  # type: ignore[arg-type]
    sft = [r for s in sequences for r in _rounds_of(s)]
    tasks = [
        Task(questions=qs, answers=ans, n=1, mode=mode, max_rounds=24)
        for k in (1, 2)
        for qs, ans in world.tasks("train", k, 2)
    ]
    engine = ScriptedEngine.oracle(tokenizer, world, mode)
    async with booted_worker(engine, local_search, tokenizer) as worker:
        trajectories = [(await worker.run_task(t, score=False)).trajectories[0] for t in tasks]
    assert all(t.correct for t in trajectories)
    rollout = [
        (r.prompt_ids.tolist(), r.response_ids.tolist()) for t in trajectories for r in t.rounds
    ]
    assert len(rollout) == len(sft) > 2 * len(tasks)
    for index, (shown, trained) in enumerate(zip(rollout, sft, strict=True)):
        assert shown[0] == trained[0], f"round {index}: the prompts differ"
        assert shown[1] == trained[1], f"round {index}: the responses differ"


def test_oracle_sequences_of_several_question_counts(tokenizer: object) -> None:
    one = oracle_sequences(tokenizer, tasks=3, k=1, mode="full")  # type: ignore[arg-type]
    two = oracle_sequences(tokenizer, tasks=3, k=2, mode="full")  # type: ignore[arg-type]
    both = oracle_sequences(tokenizer, tasks=3, k=[1, 2], mode="full")  # type: ignore[arg-type]
    assert [s.input_ids.tolist() for s in both] == [s.input_ids.tolist() for s in one + two]


def test_a_number_of_questions_given_twice_gives_twice_the_tasks(tokenizer: Any) -> None:
    once = oracle_sequences(tokenizer, tasks=3, k=[1, 2])
    twice = oracle_sequences(tokenizer, tasks=3, k=[1, 2, 2])
    assert [s.input_ids.tolist() for s in twice[: len(once)]] == [s.input_ids.tolist() for s in once]
    extra = [tokenizer.decode(s.input_ids[: s.positions[0]]) for s in twice[len(once) :]]
    assert len(extra) > 6 and all(text.count("?") >= 2 for text in extra)  # 2-question prompts
    firsts = {tokenizer.decode(s.input_ids) for s in once}
    assert not firsts & {tokenizer.decode(s.input_ids) for s in twice[len(once) :]}  # other tasks


def test_oracle_sequences_from_several_worlds(tokenizer: object) -> None:
    first = oracle_sequences(tokenizer, tasks=2, k=1, mode="full")  # type: ignore[arg-type]
    second = oracle_sequences(tokenizer, tasks=2, k=1, mode="full", world_seed=1)  # type: ignore[arg-type]
    both = oracle_sequences(tokenizer, tasks=2, k=1, mode="full", worlds=2)  # type: ignore[arg-type]
    assert [s.input_ids.tolist() for s in both] == [s.input_ids.tolist() for s in first + second]
    assert first[0].input_ids.tolist() != second[0].input_ids.tolist()


def test_oracle_sequences_never_train_on_prompts_or_information(tokenizer: object) -> None:
    sequences = oracle_sequences(tokenizer, tasks=2, k=2, mode="full")  # type: ignore[arg-type]
    assert len(sequences) == 2  # full mode: one sequence per trajectory
    for seq in sequences:
        trained = np.zeros(len(seq.input_ids), dtype=bool)
        trained[seq.positions] = True
        text = tokenizer.decode(seq.input_ids[~trained])  # type: ignore[attr-defined]
        assert text.count("<information>") == len(seq.rounds) - 1
        assert "<information>" not in tokenizer.decode(seq.input_ids[trained])  # type: ignore[attr-defined]


def _nll(model: torch.nn.Module, batch: TrainingBatch) -> float:
    with torch.no_grad():
        total = sum(
            -float(forward_logprobs(model, m)[0].sum())
            for m in micro_batches(batch, list(range(len(batch.sequences))), 8192, 2048)
        )
    return total / batch.num_tokens


def test_sft_lowers_the_loss_and_writes_a_loadable_policy(
    tiny_model_dir: Path, tokenizer: object, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    sequences = oracle_sequences(tokenizer, tasks=4, k=1, mode="both")  # type: ignore[arg-type]
    out = tmp_path / "sft"
    report = train_sft(
        tiny_model_dir, sequences, out, SftConfig(steps=12, batch_sequences=8, log_every=4)
    )
    assert report.steps == 12 and report.last_loss < 0.7 * report.first_loss
    batch = TrainingBatch.of(sequences)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tuned = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert _nll(tuned, batch) < 0.7 * _nll(base, batch)
    assert not list(tmp_path.glob(".tmp-*"))
    trainer = Trainer(TrainerConfig(beta_kl=0.0), out)  # usable as the policy
    assert trainer.vocab_size == base.config.vocab_size


@pytest.mark.parametrize("mode", ["memory", "full"])
def test_copy_weights_cover_the_mem_search_and_answer_contents(tokenizer: object, mode: str) -> None:
    sequences = oracle_sequences(tokenizer, tasks=2, k=2, mode=mode)  # type: ignore[arg-type]
    weights = copy_weights(tokenizer, sequences, 5.0)  # type: ignore[arg-type]
    batch = TrainingBatch.of(sequences)
    assert weights.shape == (batch.num_tokens,) and set(weights.tolist()) == {1.0, 5.0}
    decode = tokenizer.decode  # type: ignore[attr-defined]
    for i, seq in enumerate(sequences):
        w = weights[batch.offsets[i] : batch.offsets[i + 1]].numpy()
        heavy = decode(seq.input_ids[seq.positions[w == 5.0]])
        light = decode(seq.input_ids[seq.positions[w == 1.0]])
        for tag in ("<mem>", "</mem>", "<search>", "<answer>", "<think>", "needs the"):
            assert tag not in heavy  # tags and thoughts keep weight 1
        memory = decode(seq.input_ids[seq.positions]).split("<mem>")[1].split("</mem>")[0]
        assert memory.split(";")[0].strip() in heavy
        assert "<mem>" in light and "</mem>" in light and "<think>" in light
    answered = [i for i, s in enumerate(sequences) if "<answer>" in decode(s.input_ids[s.positions])]
    assert answered  # every task ends with an answer round, its answer weighted
    seq = sequences[answered[0]]
    w = weights[batch.offsets[answered[0]] : batch.offsets[answered[0] + 1]].numpy()
    answer = decode(seq.input_ids[seq.positions]).split("<answer>")[1].split("</answer>")[0].strip()
    assert answer in decode(seq.input_ids[seq.positions[w == 5.0]])


def test_copy_weight_scales_the_loss_of_the_copied_tokens_only(tiny_model_dir: Path, tokenizer: object) -> None:
    """The weighted loss is the weighted mean of the per-token NLL (reference below)."""
    from transformers import AutoModelForCausalLM

    from services.learner.sft import _loss

    sequences = oracle_sequences(tokenizer, tasks=1, k=2, mode="memory")  # type: ignore[arg-type]
    batch, seqs = TrainingBatch.of(sequences), list(range(len(sequences)))
    weights = copy_weights(tokenizer, sequences, 3.0)  # type: ignore[arg-type]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        nll = -torch.cat([forward_logprobs(model, m)[0] for m in micro_batches(batch, seqs, 8192, 512)])
        index = torch.cat([m.token_index for m in micro_batches(batch, seqs, 8192, 512)])
    expected = float((nll * weights[index]).sum() / weights.sum())
    plain = float(nll.mean())
    config = SftConfig(micro_batch_tokens=8192, row_tokens=512)
    assert _loss(model, batch, seqs, config, weights) == pytest.approx(expected, rel=1e-5)
    assert _loss(model, batch, seqs, config, torch.ones(batch.num_tokens)) == pytest.approx(plain, rel=1e-5)
    model.zero_grad()


def test_jsonl_rounds_train_on_the_response_only(tokenizer: object, tmp_path: Path) -> None:
    path = tmp_path / "rounds.jsonl"
    rows = [
        {"prompt": "Question: Who?\n", "response": "<mem>Q1: ?</mem><answer>Zor</answer>"},
        {"prompt_ids": [5, 6, 7], "response_ids": [8, 9]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    first, second = jsonl_sequences(tokenizer, path)  # type: ignore[arg-type]
    prompt = tokenizer.encode(rows[0]["prompt"], add_special_tokens=False)  # type: ignore[attr-defined]
    assert first.positions[0] == len(prompt) and first.positions[-1] == len(first.input_ids) - 1
    assert second.input_ids.tolist() == [5, 6, 7, 8, 9] and second.positions.tolist() == [3, 4]
    path.write_text(json.dumps(rows[1]) + "\n" + json.dumps({"prompt": "only a prompt"}) + "\n")
    with pytest.raises(ValueError, match=r"rounds.jsonl:2"):
        jsonl_sequences(tokenizer, path)  # type: ignore[arg-type]


def test_mempo_sft_command(tiny_model_dir: Path, tmp_path: Path) -> None:
    from mempo_cli import main as cli

    runner = CliRunner()
    out = tmp_path / "policy"
    args = [
        "sft",
        "--out",
        str(out),
        "--model",
        str(tiny_model_dir),
        "--steps",
        "2",
        "--tasks",
        "2",
    ]
    result = runner.invoke(cli.app, [*args, "--mode", "full", "--k", "1-2", "--track", "tensorboard"])
    assert result.exit_code == 0, result.output
    run = tmp_path / "policy-run"  # the loss of every logged step, beside the checkpoint
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [2]
    assert list((run / "tb").glob("events.out.tfevents.*"))
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["steps"] == 2 and (out / "model.safetensors").is_file()
    assert summary["sequences"] == 4  # 2 tasks of 1 question + 2 of 2, one sequence each
    for bad_k in ("2-1", "x", "0", "65"):
        refused = runner.invoke(cli.app, [*args, "--k", bad_k])
        assert refused.exit_code == 2 and "--k" in refused.output
    bad = runner.invoke(cli.app, [*args, "--mode", "sideways"])
    assert bad.exit_code == 2 and "--mode" in bad.output
    zero_lr = runner.invoke(cli.app, [*args, "--lr", "0"])
    assert zero_lr.exit_code == 2 and "--lr" in zero_lr.output
