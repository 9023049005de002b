"""Wire records: validation rules and lossless JSON round trips (plain and packed)."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from mempo.arrays import LogProbs, TokenIds
from mempo.schemas import Group, Round, Task, Trajectory, parse_weight_version


def make_round(index: int = 0, n: int = 5, rng: random.Random | None = None, **kw: object) -> Round:
    rng = rng or random.Random(index)
    fields: dict[str, object] = {
        "index": index,
        "prompt_ids": [rng.randrange(50_000) for _ in range(7)],
        "response_ids": [rng.randrange(50_000) for _ in range(n)],
        "response_logprobs": [-rng.random() * 5 for _ in range(n)],
        "mem_span": (1, 3),
        "action": "search",
        "query": "q",
        "information": "Doc 1(Title: x) y",
        "weight_version": "3",
    }
    fields.update(kw)
    return Round.model_validate(fields)


def make_group(n: int = 3, rounds: int = 2) -> Group:
    task = Task(questions=["q1", "q2"], answers=[["a"], ["b", "B"]], n=n)
    trajs = [
        Trajectory(
            rounds=[make_round(i, rng=random.Random(j * 10 + i)) for i in range(rounds)],
            answer_text="a; b", reward=1.0, correct=True, format_ok=True,
            p_mem=[0.5] * rounds, p_full=[0.25] * rounds, num_tokens=100,
        )
        for j in range(n)
    ]
    return Group(group_id=task.group_id, task=task, trajectories=trajs, policy_version=3, worker_id="w")


@pytest.mark.parametrize("pack", [False, True])
def test_group_round_trip(pack: bool) -> None:
    group = make_group()
    encoded = group.model_dump_json(context={"pack": pack})
    assert ('"b64"' in encoded) == pack
    decoded = Group.model_validate_json(encoded)
    assert decoded == group
    assert decoded.trajectories[0].rounds[0].response_logprobs == group.trajectories[0].rounds[0].response_logprobs


def test_logprobs_are_lossless_when_packed() -> None:
    r = make_round(response_ids=[1, 2], response_logprobs=[-1 / 3, -0.1], mem_span=None)
    back = Round.model_validate_json(r.model_dump_json(context={"pack": True}))
    assert back.response_logprobs.tolist() == [-1 / 3, -0.1]


def test_arrays_behave_like_lists() -> None:
    ids = TokenIds([3, 4, 5])
    assert ids == [3, 4, 5] and ids == (3, 4, 5) and ids != [3, 4]
    assert len(ids) == 3 and ids[0] == 3 and ids[1:] == [4, 5] and list(ids) == [3, 4, 5]
    assert ids.numpy().dtype.str == "<i4" and not ids.numpy().flags.writeable
    assert LogProbs([-0.5]).tolist() == [-0.5]


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("response_logprobs", [-0.1], "response_logprobs has 1 values for 5"),
        ("mem_span", (2, 9), "mem_span"),
        ("mem_span", (3, 2), "mem_span"),
        ("prompt_ids", [], "prompt_ids is empty"),
        ("prompt_ids", [-1], "token ids"),
        ("prompt_ids", [1.5], "integer"),
        ("prompt_ids", [True], "integer"),
        ("response_logprobs", [0.5, -1, -1, -1, -1], "log-probs"),
        ("response_logprobs", [float("nan")] * 5, "log-probs"),
        ("action", "jump", "action"),
        ("query", None, "search round needs its query"),
        ("prompt_ids", {"dtype": "<i4", "b64": "***"}, "base64"),
        ("prompt_ids", {"dtype": "<f8", "b64": ""}, "packed array"),
    ],
)
def test_round_validation(field: str, value: object, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        make_round(**{field: value})


def test_task_validation() -> None:
    with pytest.raises(ValidationError, match="answers has 1 alias lists for 2 questions"):
        Task(questions=["a", "b"], answers=[["x"]])
    with pytest.raises(ValidationError):
        Task(questions=["a"], answers=[[]])
    with pytest.raises(ValidationError):
        Task(questions=[], answers=[])
    with pytest.raises(ValidationError):
        Task(questions=["a"], answers=[["x"]], n=0)
    with pytest.raises(ValidationError, match="schema_version"):
        Task(questions=["a"], answers=[["x"]], schema_version=99)
    with pytest.raises(ValidationError, match="extra"):
        Task.model_validate({"questions": ["a"], "answers": [["x"]], "surprise": 1})


def test_trajectory_and_group_validation() -> None:
    r0 = make_round(0)
    with pytest.raises(ValidationError, match="indexed"):
        Trajectory(rounds=[make_round(1)])
    with pytest.raises(ValidationError, match="p_mem has 1 values but p_full has 0"):
        Trajectory(rounds=[r0], p_mem=[0.5])
    with pytest.raises(ValidationError, match="rounds with a memory"):
        Trajectory(rounds=[r0], p_mem=[0.5, 0.5], p_full=[0.5, 0.5])
    with pytest.raises(ValidationError, match="probabilities"):
        Trajectory(rounds=[r0], p_mem=[1.5], p_full=[0.5])
    assert Trajectory(rounds=[r0], p_mem=[0.75], p_full=[0.25]).memory_rewards == [0.5]
    group = make_group(n=2)
    with pytest.raises(ValidationError, match="n=2"):
        Group(group_id=group.group_id, task=group.task, trajectories=group.trajectories[:1], policy_version=0)
    with pytest.raises(ValidationError, match="group_id"):
        Group(group_id="other", task=group.task, trajectories=group.trajectories, policy_version=0)


def test_parse_weight_version() -> None:
    assert parse_weight_version("default") == 0
    assert parse_weight_version(None) == 0
    assert parse_weight_version("7") == 7
    assert parse_weight_version(3) == 3
    assert parse_weight_version("v12") == 12
    # weights that are no policy version: never replaced by the pointer, nor guessed at
    assert parse_weight_version("my-finetune-3") is None and parse_weight_version("-1") is None
    assert parse_weight_version("١٢") is None  # digits of another script are not a version


def test_json_schema_describes_arrays() -> None:
    schema = Round.model_json_schema()
    assert schema["properties"]["prompt_ids"]["type"] == "array"
    assert schema["properties"]["prompt_ids"]["items"]["type"] == "integer"


def test_p_task_and_score_task_keep_old_records_valid() -> None:
    """Records from before score_task / p_task validate (false / null); p_task lies in
    [0, 1] like p_mem; a Task is written without score_task while it is false, so a worker
    older than the field reads it."""
    group = make_group(n=1)
    old = json.loads(group.model_dump_json())
    old["schema_version"] = old["task"]["schema_version"] = 1
    for traj in old["trajectories"]:
        traj.pop("p_task", None)
    back = Group.model_validate(old)
    assert back.task.score_task is False and back.trajectories[0].p_task is None
    assert "score_task" not in group.task.model_dump_json() and "score_task" not in str(group.model_dump())
    asked = group.task.model_copy(update={"score_task": True})
    assert json.loads(asked.model_dump_json())["score_task"] is True
    assert Task.model_validate_json(asked.model_dump_json()) == asked
    assert "score_task" in Task.model_json_schema(mode="serialization")["properties"]
    r0 = make_round(0)
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValidationError, match="p_task"):
            Trajectory(rounds=[r0], p_task=bad)
    with_task = group.model_copy(
        update={"trajectories": [t.model_copy(update={"p_task": 0.25}) for t in group.trajectories]}
    )
    assert Group.model_validate_json(with_task.model_dump_json(context={"pack": True})) == with_task
