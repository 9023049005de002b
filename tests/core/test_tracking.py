"""mempo.tracking with the real packages, offline: TensorBoard event files read back by
tensorboard's own reader, an offline W&B run folder read back record by record, an
MLflow sqlite store read back by its client; a raising tracker is dropped and the run goes
on; a restarted run continues the same tracker runs without logging a step twice."""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mempo.tracking import NAMES, Tracker, check_backends

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")

ROWS = [{"questions": ["Where was Drobo born?"], "gold": ["Melthi"], "answer": "Melthi", "reward": 1.0,
         "correct": True, "format_ok": True, "tokens": 90,
         "rounds": [{"round": 1, "memory": "Q1 = ?", "think": None, "query": "Drobo", "information": "Drobo was born in Melthi.",
                     "answer": None, "p_mem": 0.25, "p_full": 0.2, "text": None},
                    {"round": 2, "memory": "Q1 = Melthi", "think": None, "query": None, "information": None,
                     "answer": "Melthi", "p_mem": 0.75, "p_full": 0.7, "text": None}]}]  # fmt: skip


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


def run_steps(run_dir: Path, steps: range, backends: list[str]) -> None:
    tracker = Tracker(run_dir, backends, config={"trainer": {"lr": 3e-4}, "group_size": 8})
    for step in steps:
        tracker.log({"pg_loss": 0.1 * step, "p_mem_mean": 0.5, "reward_mean": step / 10, "note": "text"}, step)
        if step % 2 == 0:
            tracker.log_samples(ROWS, step)
    tracker.close()


def tensorboard_scalars(folder: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_records(run_folder: Path) -> Iterator[Any]:
    """The records of an offline run's ``.wandb`` file (a leveldb-style log of protobufs)."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_folder.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    position, pending, block = 7, b"", 32768
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_history(run_dir: Path) -> dict[str, list[int]]:
    """tracker name -> steps, over every offline run folder of the run (one per start)."""
    found: dict[str, list[int]] = {}
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        for record in wandb_records(folder):
            if record.WhichOneof("record_type") == "history":
                step = record.history.step.num
                for item in record.history.item:
                    found.setdefault(item.key or "/".join(item.nested_key), []).append(step)
    return found


def mlflow_steps(run_dir: Path) -> dict[str, list[int]]:
    import json

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = json.loads((run_dir / "tracking.json").read_text())["mlflow_run_id"]
    return {name: sorted(m.step for m in client.get_metric_history(run_id, name)) for name in client.get_run(run_id).data.metrics}


def test_every_tracker_holds_the_steps_under_verl_names_and_a_restart_goes_on(tmp_path: Path) -> None:
    backends = ["tensorboard", "wandb", "mlflow"]
    run_steps(tmp_path, range(1, 4), backends)
    run_steps(tmp_path, range(3, 6), backends)  # a restart trains step 3 again: not logged twice
    want = {"actor/pg_loss": [1, 2, 3, 4, 5], "mem/p_mem": [1, 2, 3, 4, 5], "critic/score/mean": [1, 2, 3, 4, 5]}
    assert NAMES["pg_loss"] == "actor/pg_loss"
    tb = tensorboard_scalars(tmp_path / "tb")
    assert {k: tb[k] for k in want} == want and "note" not in tb
    history = wandb_history(tmp_path)
    assert {k: sorted(history[k]) for k in want} == want
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2  # one run id, resumed
    assert len({p.name.rsplit("-", 1)[-1] for p in (tmp_path / "wandb").glob("offline-run-*")}) == 1
    assert "samples/_type" in history  # the sample table
    assert mlflow_steps(tmp_path) == {**want}
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == ["step-2.jsonl", "step-4.jsonl"]
    assert list((tmp_path / "mlflow-artifacts").rglob("step-4.jsonl"))  # inside the run, never ./mlruns


class Raising:
    def log(self, metrics: Any, step: int) -> None:
        raise RuntimeError("the tracker's server went away")

    log_samples = log

    def close(self) -> None:
        pass


def test_a_raising_tracker_is_reported_once_and_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tracker = Tracker(tmp_path, ["tensorboard"])
    tracker.backends["broken"] = Raising()  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="mempo.tracking"):
        for step in range(1, 4):
            tracker.log({"pg_loss": 1.0}, step)
    tracker.close()
    assert sum("broken failed" in r.getMessage() for r in caplog.records) == 1
    assert tensorboard_scalars(tmp_path / "tb")["actor/pg_loss"] == [1, 2, 3]


def test_an_unknown_tracker_or_a_missing_package_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from mempo import tracking

    with pytest.raises(ValueError, match="unknown tracker 'neptune'"):
        check_backends(["neptune"])
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as if not installed
    assert not tracking._installed("wandb") and tracking._installed("tensorboard")
    with pytest.raises(ValueError, match=r"pip install 'mempo\[tracking\]'"):
        check_backends(["wandb"])
    assert check_backends([]) == ["jsonl"]


def test_the_name_table_of_the_docs_is_the_code_s() -> None:
    from tests.conftest import REPO

    text = (REPO / "docs" / "operations.md").read_text()
    table = dict(
        line.strip("| ").replace("`", "").split(" | ")
        for line in text.split("| metrics.jsonl | trackers |", 1)[1].splitlines()[2:]
        if line.startswith("| `")
    )
    assert table == NAMES
