"""Publishing weights: HF safetensors per version, the policy pointer, every engine told.

0. With ``weight_sync = broadcast``, first the rollout engines get the tensors (checked
   finite) over a torch.distributed group (services/learner/broadcast.py); those that
   did are done, the others go on below.
1. The trainer exports HF-format weights into a temp dir under the weights root,
   world-readable (containers run as other users) and checked finite (a NaN or inf
   tensor, or one that overflowed the export dtype, fails the publish: nothing is
   renamed, pointed at or sent), renamed to ``v{version}/``: an engine never sees half a
   version. The trainer checks the tensors while it writes them and seals the folder
   (mempo.weights.seal); another exporter's folder is read back and checked.
2. ``mempo:policy`` = {version, path}: a worker or scorer that starts late, or missed
   an update, loads it before it takes work.
3. Every other live registration gets ``POST /update_weights_from_disk`` in parallel, with a
   timeout and the admin token of its role, if it proves it holds that token (an HMAC
   of the entry, ``mempo.registry.registration_proof``; an unproven entry gets nothing):
   a rollout replica at its worker's URL (the worker forwards to its engine, which is not
   reachable from outside the replica), the scorer at its own. One that fails is reported stale and catches up from the pointer;
   the publish still succeeds for the others.
4. Versions no longer in use are deleted: older than the last ``keep_versions``, and
   not the version a stale engine still serves.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch
from redis.exceptions import RedisError

from mempo.clients.engine import EngineClient, EngineError
from mempo.files import atomic_dir
from mempo.queue import RedisQueue
from mempo.registry import EngineInfo
from mempo.schemas import parse_weight_version
from mempo.weights import check_finite, is_sealed, map_safetensors, non_finite, seal
from mempo_sim.tiny import make_world_readable
from services.learner.broadcast import WeightBroadcaster

log = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"v(\d+)")
_TEMP_PREFIX = ".tmp-v"


class WeightExporter(Protocol):
    """The trainer side of a publish: write HF-format weights into ``out_dir`` (sealed,
    mempo.weights.seal, only if it checked them finite itself: the publisher then does not
    read them back); the same tensors in memory (for a broadcast)."""

    def export_hf(self, out_dir: Path) -> Path: ...

    def export_tensors(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class PublishReport:
    version: int
    path: str
    updated: list[str] = field(default_factory=list)
    """Engine URLs that loaded the version."""
    stale: dict[str, str] = field(default_factory=dict)
    """Engine URL -> why its update failed; it catches up from the policy pointer."""
    removed: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    """Engine URL -> how long its update took (a broadcast: the whole push)."""
    paths: dict[str, str] = field(default_factory=dict)
    """Engine URL -> how it got the version: broadcast or disk (tried last)."""
    broadcast_s: float = 0.0
    export_s: float = 0.0
    notify_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.broadcast_s + self.export_s + self.notify_s


class WeightPublisher:
    """Writes versions under ``weights_root`` and pushes them to every live engine."""

    def __init__(
        self,
        queue: RedisQueue,
        weights_root: Path,
        admin_token: str | None = None,
        timeout_s: float = 300.0,
        keep_versions: int = 2,
        max_parallel: int = 64,
        role_tokens: Mapping[str, str | None] | None = None,
        protected: Path | str | None = None,
        broadcast: bool = False,
        broadcast_options: Mapping[str, Any] | None = None,
    ) -> None:
        """``role_tokens``: the admin token per registry role ("rollout": the workers',
        "scorer": the scorer's); a role not in it gets ``admin_token``. ``protected``: a
        folder never deleted (the base model the services started from, which may be a
        version folder such as ``weights/v0``)."""
        if keep_versions < 1:
            raise ValueError("keep_versions must be at least 1 (the current version)")
        self.queue = queue
        self.root = Path(weights_root)
        self.admin_token = admin_token
        self.role_tokens = dict(role_tokens or {})
        self.timeout_s = timeout_s
        self.keep_versions = keep_versions
        self.protected = Path(protected).resolve() if protected else None
        self._parallel = asyncio.Semaphore(max_parallel)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._cleanup: asyncio.Task[None] | None = None  # the last publish's deletions
        self.broadcaster: WeightBroadcaster | None = None
        if broadcast:
            self.broadcaster = WeightBroadcaster(
                self.http, lambda _: self.token_for("rollout"), timeout_s=min(timeout_s, 120.0),
                **(broadcast_options or {}),
            )

    async def aclose(self) -> None:
        await self.settled()
        if self.broadcaster is not None:
            await self.restore_held()
            await self.broadcaster.close()
        await self.http.aclose()

    async def restore_held(self) -> None:
        """Engines that a broadcast left paused on part of a version (the learner stopped,
        or a publish failed, before the disk path brought them the whole of one) load the
        last published version from disk (the base model before any), then resume: a
        stopping learner never leaves an engine paused until the next learner publishes."""
        assert self.broadcaster is not None
        if not self.broadcaster.held:
            return
        try:
            policy = await self.queue.get_policy()
        except (RedisError, ValueError) as exc:
            policy = None
            log.warning("paused engines resumed on what they hold: the policy pointer cannot be read (%s)", exc)
        target = (Path(policy.path), policy.version) if policy else (self.protected, 0) if self.protected else None
        held = sorted(self.broadcaster.held)
        if target is not None:
            token = self.token_for("rollout")
            results = await asyncio.gather(*(self._update(url, token, *target) for url in held))
            for url, (error, _) in zip(held, results, strict=True):
                if error:
                    log.warning("%s keeps part of a broadcast version: %s", url, error)
        await self.broadcaster.resume()

    def version_dir(self, version: int) -> Path:
        return self.root / f"v{version}"

    async def settled(self) -> None:
        """Wait until the last publish's old versions are deleted."""
        if self._cleanup is not None:
            await self._cleanup

    async def publish(self, exporter: WeightExporter, version: int) -> PublishReport:
        """(Broadcast to the rollout engines,) export, point ``mempo:policy`` at it,
        update every engine not at the version yet from disk; the versions no engine
        serves any more are then deleted in the background (the next publish waits for
        that first: ``settled``), off the training step's path."""
        await self.settled()
        started = time.perf_counter()
        sent, seconds = await self.broadcast(exporter, version)
        broadcast = time.perf_counter()
        path = await asyncio.to_thread(self.write_version, exporter, version)
        exported = time.perf_counter()
        await self.queue.set_policy(version, str(path))
        engines, refused = await self.engines()  # and those that registered meanwhile
        rest = [e for e in engines if _base(e.url) not in sent]
        errors, disk_seconds = await self.notify(rest, path, version)
        if self.broadcaster is not None:
            await self.broadcaster.resume()  # those a failed broadcast left paused: loaded now
        notified = time.perf_counter()
        failed = [parse_weight_version(e.weight_version) for e in engines if _base(e.url) in errors]
        in_use = {v for v in failed if v is not None}  # what the engines that failed still serve
        removed = self.unused(version, in_use)
        self._cleanup = asyncio.create_task(asyncio.to_thread(self.remove, removed))
        report = PublishReport(
            version=version,
            path=str(path),
            updated=sorted({_base(e.url) for e in engines} - set(errors)),
            stale={**refused, **errors},
            removed=removed,
            seconds={**seconds, **disk_seconds},
            paths={**{_base(e.url): "disk" for e in rest}, **dict.fromkeys(sent, "broadcast")},
            broadcast_s=broadcast - started,
            export_s=exported - broadcast,
            notify_s=notified - exported,
        )
        if errors:
            log.warning(
                "published v%d; %d engines stale: %s", version, len(errors), ", ".join(errors)
            )
        if refused:
            log.warning("published v%d; %d registry entries sent nothing (unproven): %s",
                        version, len(refused), ", ".join(refused))  # fmt: skip
        log.info(
            "published v%d to %d engines in %.2fs", version, len(report.updated), report.total_s
        )
        return report

    async def broadcast(
        self, exporter: WeightExporter, version: int
    ) -> tuple[set[str], dict[str, float]]:
        """Broadcast the version to the rollout engines (with a broadcaster): the URLs
        that hold it now, and the push's seconds for each engine tried. Checked finite
        first: a NaN or inf is never sent (the export then fails the publish too)."""
        if self.broadcaster is None:
            return set(), {}
        engines, _ = await self.engines()
        urls = sorted({_base(e.url) for e in engines if e.role == "rollout"})
        if not urls:
            return set(), {}
        tensors = await asyncio.to_thread(exporter.export_tensors)
        if non_finite(tensors) is not None:
            return set(), {}
        started = time.perf_counter()
        errors = await self.broadcaster.push(tensors, version, urls)
        took = time.perf_counter() - started
        for url, error in errors.items():
            if error:
                log.warning("broadcast of v%d to %s failed (it loads from disk): %s", version, url, error)
        return {u for u, e in errors.items() if e is None}, dict.fromkeys(errors, took)

    def write_version(self, exporter: WeightExporter, version: int) -> Path:
        """``v{version}/`` written atomically (temp dir + rename), checked finite,
        world-readable and sealed (mempo.weights.seal). An export that sealed itself (the
        trainer's: it checks the tensors as it writes them) is not read back."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        final = self.version_dir(version)  # re-published after a resume: replaced
        with atomic_dir(final, prefix=f"{_TEMP_PREFIX}{version}-") as tmp:
            exporter.export_hf(tmp)
            if not is_sealed(tmp):
                check_finite(map_safetensors(tmp), f"weights version {version}")
                make_world_readable(tmp)
                seal(tmp)  # last: the receivers need not scan what was just checked finite
        return final

    async def notify(
        self, engines: list[EngineInfo], path: Path, version: int
    ) -> tuple[dict[str, str], dict[str, float]]:
        """Update every engine (each URL once) in parallel: (URL -> error of those that
        failed, URL -> seconds of each call)."""
        roles = {_base(e.url): e.role for e in engines}
        urls = sorted(roles)
        results = await asyncio.gather(
            *(self._update(url, self.token_for(roles[url]), path, version) for url in urls)
        )
        errors = {url: error for url, (error, _) in zip(urls, results, strict=True) if error}
        return errors, {url: took for url, (_, took) in zip(urls, results, strict=True)}

    async def engines(self) -> tuple[list[EngineInfo], dict[str, str]]:
        """The registered engines this learner may send to, and URL -> why for the others.
        An entry of a role with an admin token must prove it holds that token
        (``EngineInfo.proof``); any other is sent nothing, neither the token nor weights."""
        trusted, refused = [], {}
        for engine in await self.queue.list_engines():
            token = self.token_for(engine.role)
            if token is None or engine.proven(token):
                trusted.append(engine)
            else:
                refused[_base(engine.url)] = (
                    f"registry entry {engine.id!r} does not prove the {engine.role} admin token "
                    "(a forged entry, or a token that differs from the learner's): sent nothing"
                )[:500]
        return trusted, refused

    def token_for(self, role: str) -> str | None:
        return self.role_tokens.get(role, self.admin_token)

    async def _update(
        self, url: str, token: str | None, path: Path, version: int
    ) -> tuple[str | None, float]:
        client = EngineClient(url, admin_token=token, client=self.http)
        async with self._parallel:
            started = time.perf_counter()
            try:
                reply = await asyncio.wait_for(
                    client.update_weights_from_disk(str(path), str(version)), self.timeout_s
                )
                error = None if reply.success else (reply.message or "success=false")
            except (EngineError, httpx.HTTPError, TimeoutError, ValueError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        return (error[:500] if error else None), time.perf_counter() - started

    def unused(self, version: int, in_use: set[int]) -> list[int]:
        """Versions older than the last ``keep_versions`` that no engine serves, except the
        protected folder (or one holding it)."""
        keep = set(range(version - self.keep_versions + 1, version + 1)) | in_use
        return [
            number
            for number in self.versions()
            if number < version and number not in keep and not self._holds_protected(number)
        ]

    def remove(self, versions: list[int]) -> None:
        for number in versions:
            shutil.rmtree(self.version_dir(number), ignore_errors=True)

    def _holds_protected(self, version: int) -> bool:
        folder = self.version_dir(version).resolve()
        return self.protected is not None and (self.protected == folder or folder in self.protected.parents)

    def versions(self) -> list[int]:
        """The versions present under the weights root, ascending."""
        if not self.root.is_dir():
            return []
        found = (_VERSION_DIR.fullmatch(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def remove_temp(self) -> None:
        """Drop half-written versions a crash left behind (call once at start)."""
        if self.root.is_dir():
            for path in self.root.glob(f"{_TEMP_PREFIX}*"):
                shutil.rmtree(path, ignore_errors=True)


def _base(url: str) -> str:
    return url.rstrip("/")
