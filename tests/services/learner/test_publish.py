"""Weight publishing: versions on disk, the policy pointer, every engine and the scorer."""

from __future__ import annotations

import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from mempo import weights
from mempo.keys import Keys
from mempo.procs import free_port
from mempo.queue import RedisQueue
from mempo.registry import EngineInfo
from mempo.weights import NonFiniteWeights, map_safetensors
from mempo_sim.tiny import make_world_readable
from services.learner import publish
from services.learner.publish import WeightPublisher
from tests.services.learner.service_support import StandInEngine, serving

TOKEN = "admin-secret"


class CopyExporter:
    """Exports a fixed HF folder (the tiny model), as the trainer's export_hf would."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.exports = 0

    def export_hf(self, out_dir: Path) -> Path:
        self.exports += 1
        for name in ("config.json", "model.safetensors"):
            shutil.copy(self.source / name, out_dir / name)
        (out_dir / "model.safetensors").chmod(0o600)  # as safetensors saves it
        return out_dir


class PoisonedExporter(CopyExporter):
    """The tiny model with one NaN weight (what a NaN step would have exported)."""

    def export_hf(self, out_dir: Path) -> Path:
        super().export_hf(out_dir)
        state = load_file(str(out_dir / "model.safetensors"))
        name = sorted(n for n, t in state.items() if t.is_floating_point())[0]
        state[name].view(-1)[0] = float("nan")
        save_file(state, str(out_dir / "model.safetensors"))
        return out_dir


class SealingExporter(CopyExporter):
    """Checks and seals its own folder, as the trainer's export does."""

    def export_hf(self, out_dir: Path) -> Path:
        super().export_hf(out_dir)
        weights.check_finite(map_safetensors(out_dir), "export")
        make_world_readable(out_dir)
        weights.seal(out_dir)
        return out_dir


class BrokenExporter:
    def export_hf(self, out_dir: Path) -> Path:
        (out_dir / "half.bin").write_bytes(b"x")
        raise OSError("disk full")


@pytest.fixture
def engines() -> Iterator[list[StandInEngine]]:
    fleet = [
        StandInEngine("engine-a", admin_token=TOKEN),
        StandInEngine("engine-b", admin_token=TOKEN),
        StandInEngine("scorer", admin_token=TOKEN),
    ]
    with serving([e.app() for e in fleet]) as urls:
        for engine, url in zip(fleet, urls, strict=True):
            engine.url = url
        yield fleet


async def _register(queue: RedisQueue, fleet: list[StandInEngine]) -> None:
    for engine in fleet:
        role = "scorer" if engine.name == "scorer" else "rollout"
        await queue.register_engine(EngineInfo(id=engine.name, role=role, url=engine.url).signed(TOKEN))


async def test_a_publish_reaches_two_engines_and_the_scorer(
    redis_client: object,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    engines: list[StandInEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    await _register(queue, engines)
    publisher = WeightPublisher(queue, tmp_path / "weights", admin_token=TOKEN, timeout_s=30)
    try:
        report = await publisher.publish(CopyExporter(tiny_model_dir), version=1)
    finally:
        await publisher.aclose()
    path = tmp_path / "weights" / "v1"
    assert report.path == str(path) and report.stale == {}
    assert report.updated == sorted(e.url for e in engines)
    for engine in engines:
        assert engine.calls == [
            {
                "model_path": str(path),
                "weight_version": "1",
                "abort_all_requests": False,
                "authorization": f"Bearer {TOKEN}",
            }
        ]
    policy = await queue.get_policy()
    assert policy is not None and (policy.version, policy.path) == (1, str(path))
    mode = (path / "model.safetensors").stat().st_mode
    assert mode & stat.S_IROTH and (path.stat().st_mode & stat.S_IXOTH)  # world-readable
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v1"]  # no temp dir left
    assert report.total_s >= report.export_s > 0
    # Sealed after its check: a receiver loads it without scanning every byte again.
    scans: list[object] = []
    monkeypatch.setattr(weights, "non_finite", scans.append)
    state = weights.load_checked(path, map_safetensors(tiny_model_dir), tmp_path / "weights")
    assert state.keys() == map_safetensors(tiny_model_dir).keys() and not scans


async def test_a_failing_engine_is_stale_and_the_others_are_updated(
    redis_client: object,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    engines: list[StandInEngine],
) -> None:
    engines[1].fail = True
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    await _register(queue, engines)
    dead_url = f"http://127.0.0.1:{free_port()}"  # registered, but nothing listens
    await queue.register_engine(EngineInfo(id="gone", url=dead_url).signed(TOKEN))
    await queue.register_engine(EngineInfo(id="twin", url=engines[0].url + "/").signed(TOKEN))  # same engine
    publisher = WeightPublisher(queue, tmp_path / "w", admin_token=TOKEN, timeout_s=10)
    try:
        report = await publisher.publish(CopyExporter(tiny_model_dir), version=3)
    finally:
        await publisher.aclose()
    assert sorted(report.stale) == sorted([engines[1].url, dead_url])
    assert "cannot load" in report.stale[engines[1].url]
    assert "Connect" in report.stale[dead_url]
    assert report.updated == sorted([engines[0].url, engines[2].url])
    assert len(engines[0].calls) == 1  # two registrations of one URL: one update
    assert engines[0].weight_version == engines[2].weight_version == "3"
    assert (await queue.get_policy()).version == 3  # type: ignore[union-attr]


async def test_a_learner_with_another_token_sends_nothing_and_reports_the_engine_stale(
    redis_client: object,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    engines: list[StandInEngine],
) -> None:
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    await _register(queue, engines[:1])
    publisher = WeightPublisher(queue, tmp_path / "w", admin_token="wrong", timeout_s=10)
    try:
        report = await publisher.publish(CopyExporter(tiny_model_dir), version=1)
    finally:
        await publisher.aclose()
    assert "does not prove the rollout admin token" in report.stale[engines[0].url]
    assert report.updated == [] and engines[0].calls == []  # not even a refused call: no token sent


async def test_old_versions_are_removed_unless_an_engine_serves_them(
    redis_client: object,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    engines: list[StandInEngine],
) -> None:
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    await _register(queue, engines[:1])
    publisher = WeightPublisher(queue, tmp_path / "w", admin_token=TOKEN, keep_versions=2)
    exporter = CopyExporter(tiny_model_dir)
    try:
        for version in (1, 2, 3):
            await publisher.publish(exporter, version)
        await publisher.settled()  # deletions run after the publish, off the step's path
        assert publisher.versions() == [2, 3]
        # engine-b failed to load anything after v2 and still serves it
        engines[1].fail = True
        await queue.register_engine(
            EngineInfo(id="engine-b", url=engines[1].url, weight_version="2").signed(TOKEN)
        )
        report = await publisher.publish(exporter, 4)
        await publisher.settled()
        assert report.removed == [] and publisher.versions() == [2, 3, 4]
        engines[1].fail = False
        report = await publisher.publish(exporter, 5)
        assert report.removed == [2, 3]
        await publisher.settled()
        assert publisher.versions() == [4, 5]
    finally:
        await publisher.aclose()


async def test_the_base_model_is_never_removed_even_as_a_version(
    redis_client: object, keys: Keys, tmp_path: Path, tiny_model_dir: Path, engines: list[StandInEngine]
) -> None:
    """MODEL=/weights/v0 (a layout services/rollout/entrypoint.sh suggests): v0 is kept
    however old, so a restarted learner, scorer or worker can still start from it."""
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    await _register(queue, engines[:1])
    base = tmp_path / "w" / "v0"
    shutil.copytree(tiny_model_dir, base)
    publisher = WeightPublisher(queue, tmp_path / "w", admin_token=TOKEN, keep_versions=2, protected=base)
    exporter = CopyExporter(tiny_model_dir)
    try:
        for version in (1, 2, 3, 4):
            await publisher.publish(exporter, version)
        await publisher.settled()
        assert publisher.versions() == [0, 3, 4] and (base / "model.safetensors").is_file()
    finally:
        await publisher.aclose()


async def test_a_failed_export_publishes_nothing(
    redis_client: object,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    engines: list[StandInEngine],
) -> None:
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    await _register(queue, engines)
    root = tmp_path / "w"
    publisher = WeightPublisher(queue, root, admin_token=TOKEN)
    try:
        await publisher.publish(CopyExporter(tiny_model_dir), 1)
        with pytest.raises(OSError, match="disk full"):
            await publisher.publish(BrokenExporter(), 2)
        assert publisher.versions() == [1] and [p.name for p in root.iterdir()] == ["v1"]
        assert (await queue.get_policy()).version == 1  # type: ignore[union-attr]
        assert all(len(e.calls) == 1 for e in engines)
        (root / ".tmp-v7-crashed").mkdir()  # what a killed process leaves behind
        publisher.remove_temp()
        assert [p.name for p in root.iterdir()] == ["v1"]
        await publisher.publish(CopyExporter(tiny_model_dir), 1)  # a republish replaces it
        assert (root / "v1" / "model.safetensors").exists()
    finally:
        await publisher.aclose()


async def test_an_export_sealed_by_its_exporter_is_not_read_back(
    redis_client: object, keys: Keys, tmp_path: Path, tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    reads = []
    monkeypatch.setattr(publish, "map_safetensors", lambda path: reads.append(path) or {})
    publisher = WeightPublisher(RedisQueue(redis_client, keys), tmp_path / "w")  # type: ignore[arg-type]
    try:
        await publisher.publish(SealingExporter(tiny_model_dir), 1)
        assert reads == [] and weights.is_sealed(tmp_path / "w" / "v1")
        await publisher.publish(CopyExporter(tiny_model_dir), 2)  # not sealed: read back, sealed
        assert len(reads) == 1 and weights.is_sealed(tmp_path / "w" / "v2")
    finally:
        await publisher.aclose()


async def test_non_finite_weights_are_never_published(
    redis_client: object,
    keys: Keys,
    tmp_path: Path,
    tiny_model_dir: Path,
    engines: list[StandInEngine],
) -> None:
    queue = RedisQueue(redis_client, keys)  # type: ignore[arg-type]
    await _register(queue, engines)
    root = tmp_path / "w"
    publisher = WeightPublisher(queue, root, admin_token=TOKEN)
    try:
        await publisher.publish(CopyExporter(tiny_model_dir), 1)
        with pytest.raises(NonFiniteWeights, match="weights version 2"):
            await publisher.publish(PoisonedExporter(tiny_model_dir), 2)
        assert [p.name for p in root.iterdir()] == ["v1"]  # nothing renamed into place
        assert (await queue.get_policy()).version == 1  # type: ignore[union-attr]
        assert all(len(e.calls) == 1 for e in engines)  # no engine was told
    finally:
        await publisher.aclose()
