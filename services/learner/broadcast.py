"""The weight broadcast: the learner pushes its tensors to the rollout engines over a
torch.distributed group (gloo on CPU, NCCL on GPU), SGLang's protocol (mempo/weight_sync.py).

One push:

1. every engine is paused (``retract``: running requests go back to the queue);
2. if the set of engines changed since the last push (or that push failed), a new group
   is made: the learner is rank 0 and holds its store at ``master_address:port``; engine
   i (in URL order) joins at rank i + 1 (``/init_weights_update_group``, all at once);
3. bucket by bucket (``bucket_bytes`` each, flattened: one collective per bucket), the
   learner announces the bucket in the group's store (the bytes it broadcasts, a digest of
   what it tells the engines: mempo/weight_sync.py), then every engine is told the bucket's
   names, dtypes and shapes (``/update_weights_from_distributed``, the weight version on
   the last bucket) while the learner broadcasts its bytes;
4. every engine that loaded the version is resumed (``/continue_generation``; never while
   a bucket is in flight); one that failed after it was paused stays paused, so that it
   never generates on a part of a version, until the publisher has loaded the whole
   version into it from disk (``resume``).

An engine that fails any of it is reported with its error and the group is dropped (the
next push makes a new one); the publisher then brings the engines not at the new version
to it from disk (services/learner/publish.py), so a failure in the middle of a push leaves
every engine on a whole version, and the run goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from mempo.api.engine import UpdateWeightsResponse
from mempo.clients.engine import EngineClient, EngineError
from mempo.weight_buckets import buckets, dtype_name, flatten
from mempo.weight_sync import (
    FLATTENED,
    JoinCancelled,
    Joining,
    WeightGroup,
    announce_bucket,
    broadcast,
    listen_socket,
)

log = logging.getLogger(__name__)

ENGINE_ERRORS = (EngineError, httpx.HTTPError, TimeoutError, ValueError)


@dataclass
class _Membership:
    urls: tuple[str, ...]
    name: str
    group: WeightGroup | None


class WeightBroadcaster:
    def __init__(
        self,
        http: httpx.AsyncClient,
        token_for: Callable[[str], str | None],
        master_address: str = "127.0.0.1",
        port: int = 0,
        backend: str = "gloo",
        bucket_bytes: int = 256 * 1024 * 1024,
        timeout_s: float = 60.0,
    ) -> None:
        """``token_for(url)``: the admin token of the engine (its worker) at ``url``;
        ``master_address``: where the engines reach this learner (the group's store and
        gloo listen on that address only); ``port`` 0: a free one for each group."""
        self.http = http
        self.token_for = token_for
        self.master_address = master_address
        self.port = port
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._members: _Membership | None = None
        self._generation = itertools.count(1)
        self.held: set[str] = set()  # engines a failed push left paused

    async def push(
        self, tensors: Mapping[str, torch.Tensor], version: int, urls: list[str]
    ) -> dict[str, str | None]:
        """Broadcast ``tensors`` as weight version ``version`` to the engines at ``urls``:
        URL -> None when it holds the version, else why not."""
        urls = sorted(set(urls))
        if not urls:
            return {}
        clients = {u: EngineClient(u, admin_token=self.token_for(u), client=self.http) for u in urls}
        errors: dict[str, str | None] = dict.fromkeys(urls)
        await self._each(clients, errors, lambda c: c.pause_generation("retract"))
        paused = {u: c for u, c in clients.items() if errors[u] is None}
        loaded: set[str] = set()
        try:
            if paused:  # one that could not be paused is left out (the disk path brings it)
                loaded = await self._send(paused, errors, tensors, version)
        finally:
            # Those that did not load every bucket may hold a part of the version: they stay
            # paused until the disk path has brought the whole of it (``resume``).
            self.held = set(paused) - loaded
            done: dict[str, str | None] = {u: None for u in urls if u not in self.held}
            await self._each({u: clients[u] for u in done}, done, lambda c: c.continue_generation())
        for url in self.held:
            errors[url] = errors[url] or "the broadcast stopped before its last bucket"
        if self.held:
            await self.close()  # the group's state is unknown: the next push makes a new one
        return errors

    async def resume(self) -> None:
        """Continue the engines a failed push left paused (after their disk update, which
        a paused engine applies at once); one that cannot be reached is left."""
        held, self.held = self.held, set()
        clients = {u: EngineClient(u, admin_token=self.token_for(u), client=self.http) for u in held}
        errors: dict[str, str | None] = dict.fromkeys(held)
        await self._each(clients, errors, lambda c: c.continue_generation())

    async def _send(
        self,
        clients: dict[str, EngineClient],
        errors: dict[str, str | None],
        tensors: Mapping[str, torch.Tensor],
        version: int,
    ) -> set[str]:
        """The engines that loaded every bucket; the others' errors in ``errors``."""
        urls = tuple(clients)
        if self._members is None or self._members.urls != urls:
            await self.close()
            self._members = await self._join(clients, errors)
            if self._members is None:
                return set()
        members = self._members
        group = members.group
        assert group is not None  # a membership without a group is never kept
        parts = buckets(sorted(tensors.items()), self.bucket_bytes)
        for i, part in enumerate(parts):
            names = [name for name, _ in part]
            dtypes = [dtype_name(t.dtype) for _, t in part]
            shapes = [list(t.shape) for _, t in part]
            last = str(version) if i == len(parts) - 1 else None
            flat = flatten(part)
            try:  # what is broadcast next, before the engines are told (they check it)
                await asyncio.to_thread(
                    announce_bucket, group, names, dtypes, shapes, FLATTENED, flat.numel()
                )
            except RuntimeError as exc:  # the store is gone
                for url in urls:
                    errors[url] = f"bucket {i + 1}/{len(parts)}: announcing it: {exc}"
                return set()
            calls = {
                u: asyncio.create_task(c.update_weights_from_distributed(
                    names, dtypes, shapes, last, members.name, FLATTENED))
                for u, c in clients.items()
            }  # fmt: skip
            sent = await asyncio.to_thread(_broadcast_or_error, group, flat)
            for url, call in calls.items():
                try:
                    reply = await asyncio.wait_for(call, self.timeout_s)
                    if not reply.success:
                        errors[url] = f"bucket {i + 1}/{len(parts)}: {reply.message}"
                except ENGINE_ERRORS as exc:
                    errors[url] = f"bucket {i + 1}/{len(parts)}: {type(exc).__name__}: {exc}"
            if sent is not None:
                for url in urls:
                    errors[url] = errors[url] or f"bucket {i + 1}/{len(parts)}: broadcast: {sent}"
            if any(errors[u] for u in urls):
                return set()
        return set(urls)

    async def _join(
        self, clients: dict[str, EngineClient], errors: dict[str, str | None]
    ) -> _Membership | None:
        """A new group of this learner (rank 0) and the engines, in URL order."""
        urls = tuple(clients)
        name = f"mempo-weights-{next(self._generation)}"
        world = len(urls) + 1
        started = time.perf_counter()
        try:  # bound before the engines are asked: on master_address only, never refused
            listening = listen_socket(self.master_address, self.port)
        except OSError as exc:
            where = f"{self.master_address}:{self.port}"
            for url in urls:
                errors[url] = f"the weight group's store on {where}: {exc}"
            return None
        port = int(listening.getsockname()[1])
        asks = [
            asyncio.create_task(c.init_weights_update_group(
                self.master_address, port, rank, world, name, self.backend))
            for rank, c in enumerate(clients.values(), start=1)
        ]  # fmt: skip
        joining = Joining(
            self.master_address, port, 0, world, name, self.backend, self.timeout_s,
            listen=listening,
        )  # fmt: skip
        group: WeightGroup | None = None
        reason = ""
        try:
            group = await _first_refusal_cancels(joining, dict(zip(urls, asks, strict=True)))
        except (JoinCancelled, TimeoutError, RuntimeError, ValueError, OSError) as exc:
            reason = f"joining the weight group: {exc}"
        finally:
            await joining.ended(5.0)  # the store holds its own copy of the socket
            listening.close()
        if group is None:  # the engines still joining wait for a store that is gone
            await asyncio.wait(asks, timeout=2.0)
            for ask in asks:
                ask.cancel()
            await asyncio.gather(*asks, return_exceptions=True)  # cancelled by now
        for url, ask in zip(urls, asks, strict=True):
            if ask.cancelled():
                errors[url] = reason
                continue
            try:
                reply = await asyncio.wait_for(ask, self.timeout_s)
                if not reply.success:
                    errors[url] = reply.message
            except ENGINE_ERRORS as exc:
                errors[url] = f"{type(exc).__name__}: {exc}"
            if group is None:
                errors[url] = errors[url] or reason
        if group is None or any(errors[u] for u in urls):
            self._members = _Membership(urls, name, group)
            await self.close()  # those that joined leave
            return None
        log.info(
            "weight group %s: %d engines joined in %.2fs (%s, port %d)",
            name, len(urls), time.perf_counter() - started, self.backend, port,
        )  # fmt: skip
        return _Membership(urls, name, group)

    async def _each(
        self,
        clients: dict[str, EngineClient],
        errors: dict[str, str | None],
        call: Callable[[EngineClient], object],
    ) -> None:
        """``call`` on every engine without an error yet, in parallel; failures recorded."""
        live = [u for u in clients if errors[u] is None]
        results = await asyncio.gather(
            *(asyncio.wait_for(call(clients[u]), self.timeout_s) for u in live),  # type: ignore[arg-type]
            return_exceptions=True,
        )
        for url, result in zip(live, results, strict=True):
            if isinstance(result, BaseException):
                errors[url] = f"{type(result).__name__}: {result}"

    async def close(self) -> None:
        """Leave the current group (the engines are told; one that cannot be is left)."""
        members, self._members = self._members, None
        if members is None:
            return
        for url in members.urls:
            client = EngineClient(url, admin_token=self.token_for(url), client=self.http)
            try:
                await asyncio.wait_for(client.destroy_weights_update_group(members.name), 10)
            except (*ENGINE_ERRORS, asyncio.TimeoutError) as exc:
                log.info("%s: leaving weight group %s: %s", url, members.name, exc)


async def _first_refusal_cancels(
    joining: Joining, asks: dict[str, asyncio.Task[UpdateWeightsResponse]]
) -> WeightGroup:
    """The learner's end of a new group; given up as soon as an engine answers that it
    could not join (the group cannot be made: waiting for it would hold the publish for
    the whole timeout)."""
    waiter = asyncio.create_task(joining.wait())
    pending: set[asyncio.Future[Any]] = {waiter, *asks.values()}
    while not waiter.done():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for url, ask in asks.items():
            if ask in done and (ask.exception() is not None or not ask.result().success):
                joining.cancel(f"{url} could not join")
    return await waiter


def _broadcast_or_error(group: WeightGroup, tensor: torch.Tensor) -> str | None:
    try:
        broadcast(group, tensor)
    except RuntimeError as exc:  # a peer gone: gloo's connection errors, its timeout
        return str(exc)[:300]
    return None
