"""Weights over torch.distributed: the group a learner and its engines join, and buckets.

SGLang's protocol (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``): the learner is rank 0 of a process group of its own,
each engine joins it at its ``rank_offset``; then, bucket by bucket, every engine is told
the bucket's names, dtypes and shapes over HTTP while the learner broadcasts the bytes.
With ``load_format="flattened_bucket"`` a bucket travels as one uint8 tensor, the
tensors' bytes one after the other in the order named (SGLang's FlattenedTensorBucket):
one collective per bucket, not one per tensor.

The group is made as SGLang makes it (``init_custom_process_group``): a TCP store at
``master_address:master_port`` (the learner, rank 0, holds it), prefixed with the group
name, and a process group over that store, apart from any default group (the learner's
FSDP group is another). gloo on CPU (this is what runs here), NCCL on GPU.

What mempo adds, the collectives unchanged (an SGLang engine sees SGLang's protocol):

- The learner's store listens on ``master_address`` only (``listen_socket``), and its
  gloo device too, not on every interface.
- Before each bucket the learner announces in the store what it is about to broadcast:
  the bytes of the tensor it sends and a digest of the names, dtypes, shapes and format
  it tells the engines (``announce_bucket``). The CPU engine compares that with the
  request before it posts the receive (``check_bucket``) and refuses a bucket that does
  not match or was not announced: gloo aborts the process when more bytes come than were
  posted, and loads the stale tail of the buffer when fewer come.
- An engine joins in a thread of its own (``Joining``) that gives up at its deadline or
  when cancelled, however the learner's end behaves: its sockets to the store are shut
  down, which ends torch's wait for a store that accepted the connection and never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mempo.tcp_sockets import is_ip, shutdown_connections, socket_inodes

log = logging.getLogger(__name__)

GROUP = "weight_update_group"
FLATTENED = "flattened_bucket"
BUCKET_KEY = "mempo/bucket"  # + "/<index>": the learner's announcement of a bucket
CONNECT_STEP_S = 2.0  # one try of torch's store client, which cannot be stopped in a try
REAP_PERIOD_S = 0.05

Group = Any  # a c10d backend: ProcessGroupGloo or ProcessGroupNCCL (no common stub type)


class JoinCancelled(Exception):
    """The join was given up (a newer join took its place, or its deadline passed)."""


class BucketMismatch(ValueError):
    """A bucket's request does not describe what the learner announced it broadcasts."""


@dataclass(eq=False)
class WeightGroup:
    """A joined weight-update group: its process group, its (prefixed) store and the
    number of buckets announced (the learner) or checked (an engine) in it so far."""

    name: str
    backend: Group
    store: Any  # dist.PrefixStore
    rank: int
    buckets: int = field(default=0)


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = GROUP,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    *,
    listen: socket.socket | None = None,
    cancelled: threading.Event | None = None,
    peers: set[str] | None = None,
) -> WeightGroup:
    """Join (rank 0: open) the weight-update group; returns once every rank has joined.

    Rank 0 with ``listen`` (``listen_socket``): the store serves on that socket (and the
    gloo device binds its address), not on every interface. A rank > 0 connects within
    ``timeout_s`` (a refused port is retried until then) and stops trying once
    ``cancelled`` is set. The addresses of the store are added to ``peers``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend {backend!r}: gloo or nccl")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("backend nccl needs CUDA: on CPU use gloo")
    deadline = time.monotonic() + timeout_s
    timeout = timedelta(seconds=timeout_s)
    device_host = ""
    if rank == 0:
        if peers is not None:  # its own client connects there
            with contextlib.suppress(OSError):
                infos = socket.getaddrinfo(master_address, master_port, type=socket.SOCK_STREAM)
                peers.update(str(info[4][0]) for info in infos)
        if listen is not None and is_ip(host := str(listen.getsockname()[0])):
            unspecified = ipaddress.ip_address(host.split("%")[0]).is_unspecified
            device_host = "" if unspecified else host  # 0.0.0.0: gloo's default device
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=True, timeout=timeout,
            master_listen_fd=None if listen is None else os.dup(listen.fileno()),
            use_libuv=True,
        )  # fmt: skip
    else:
        store = _connect_store(
            master_address,
            master_port,
            world_size,
            deadline,
            cancelled or threading.Event(),
            peers if peers is not None else set(),
        )
    prefixed = dist.PrefixStore(group_name, store)
    pg = _process_group(prefixed, rank, world_size, backend, timeout, device_host)
    store.set_timeout(timeout)  # a rank > 0 joined with what was left of it
    return WeightGroup(group_name, pg, prefixed, rank)


def _process_group(
    store: Any, rank: int, world_size: int, backend: str, timeout: timedelta, device_host: str
) -> Group:
    """The group's process group over its prefixed ``store``: gloo, its device bound to
    ``device_host`` when one is given (else gloo's default device), or NCCL."""
    if backend == "gloo" and device_host:  # the device binds the store's address
        options = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009 (not in the stubs)
        options._timeout = timeout
        options._threads = 2  # as the timeout-only constructor
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=device_host)]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    nccl_options = dist.ProcessGroupNCCL.Options()
    nccl_options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, nccl_options)


def _connect_store(
    address: str,
    port: int,
    world_size: int,
    deadline: float,
    cancelled: threading.Event,
    peers: set[str],
) -> Any:
    """A client of the store at ``address:port`` by ``deadline``.

    A port that refuses is retried here (torch's client would retry it for about twice
    its timeout, and could not be stopped); once something accepts, torch's client
    connects in tries of at most ``CONNECT_STEP_S``."""
    last: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if cancelled.is_set():
            raise JoinCancelled(f"the join of {address}:{port} was given up")
        if remaining <= 0:
            raise TimeoutError(f"no weight-group store at {address}:{port}: {last}")
        try:
            infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
            peers.update(str(info[4][0]) for info in infos)
            with socket.create_connection((address, port), timeout=min(remaining, 1.0)):
                pass  # something accepts: now torch's client
        except OSError as exc:  # refused, unreachable, unresolved
            last = exc
            time.sleep(min(0.2, max(remaining, 0.0)))
            continue
        try:
            step = timedelta(seconds=max(min(remaining, CONNECT_STEP_S), 0.001))
            store = dist.TCPStore(address, port, world_size, is_master=False, timeout=step)
        except RuntimeError as exc:  # DistNetworkError: refused, reset, timed out
            last = exc
            continue
        # the group's rendezvous waits in the store for the other ranks: what is left
        store.set_timeout(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        return store


class Joining:
    """One join of a weight-update group in a thread of its own.

    ``wait`` answers by the deadline (``timeout_s`` from the start) or once ``cancel`` is
    called, whatever the other end does; a join that is given up has its sockets to the
    store shut down until its thread has ended (torch waits without a timeout for a store
    that accepted the connection and never answers; rank 0 waits in its own store for the
    others), and a group it makes after all is dropped."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
        listen: socket.socket | None = None,
    ) -> None:
        """``listen``: rank 0's (``join_group``); the caller closes it once this has ended."""
        self.args = (master_address, master_port, rank, world_size, group_name, backend)
        self.listen = listen
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.port = master_port
        self.peers: set[str] = set()  # the store's addresses, as the thread resolved them
        self.reason = ""
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._result: WeightGroup | BaseException | None = None
        self._lock = threading.Lock()
        self._before = socket_inodes()  # not this join's
        self._thread = threading.Thread(
            target=self._run, name=f"weight-join-{group_name[:32]}", daemon=True
        )
        self._reaper: threading.Thread | None = None
        self._thread.start()

    def _run(self) -> None:
        address, port, rank, world, name, backend = self.args
        try:
            group: WeightGroup | BaseException = join_group(
                address, port, rank, world, name, backend, self.timeout_s,
                listen=self.listen, cancelled=self._cancelled, peers=self.peers,
            )  # fmt: skip
        except BaseException as exc:  # handed to the waiter
            group = exc
        with self._lock:
            if self._cancelled.is_set() and isinstance(group, WeightGroup):
                group = JoinCancelled(self.reason)  # the group made after all is dropped
            self._result = group
            self._done.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def wait(self) -> WeightGroup:
        """The group; raises JoinCancelled (given up), TimeoutError (the deadline), or
        the join's error."""
        while not self._done.is_set():
            if self._cancelled.is_set():
                raise JoinCancelled(self.reason)
            if time.monotonic() >= self.deadline:
                self.cancel(f"no group within {self.timeout_s:g}s")
                raise TimeoutError(self.reason)
            await asyncio.sleep(REAP_PERIOD_S)
        result, self._result = self._result, None  # the caller's alone: dropped, it closes
        if isinstance(result, WeightGroup):
            return result
        raise result if result is not None else JoinCancelled("the group was taken already")

    def cancel(self, reason: str) -> None:
        """Give the join up: its waiter answers now, its thread is made to end."""
        with self._lock:
            if self._cancelled.is_set():
                return
            self.reason = reason
            self._cancelled.set()
            if self._done.is_set():
                return
        self._reaper = threading.Thread(target=self._reap, name="weight-join-reaper", daemon=True)
        self._reaper.start()

    async def ended(self, timeout_s: float) -> bool:
        """Whether the join's thread has ended within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(REAP_PERIOD_S)
        return not self._thread.is_alive()

    def _reap(self) -> None:
        give_up = time.monotonic() + self.timeout_s + 30.0
        while self._thread.is_alive() and time.monotonic() < give_up:
            shutdown_connections(set(self.peers), self.port, self._before)  # a copy: it grows
            self._thread.join(REAP_PERIOD_S)


def listen_socket(address: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``address`` only (``port`` 0: a free one) for the
    learner's store (``join_group(listen=...)``)."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def broadcast(group: WeightGroup | Group, tensor: torch.Tensor, src: int = 0) -> None:
    """Send (rank ``src``) or receive ``tensor`` in place; blocks until done."""
    options = dist.BroadcastOptions()
    options.rootRank = src
    backend = group.backend if isinstance(group, WeightGroup) else group
    backend.broadcast([tensor], options).wait()


def bucket_announcement(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    load_format: str | None,
    nbytes: int,
) -> dict[str, Any]:
    """What a bucket's announcement holds: the bytes broadcast and a digest of the request."""
    described = json.dumps(
        [list(names), list(dtypes), [list(s) for s in shapes], load_format or ""],
        separators=(",", ":"),
    )
    return {"nbytes": nbytes, "sha256": hashlib.sha256(described.encode()).hexdigest()}


def announce_bucket(
    group: WeightGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    load_format: str | None,
    nbytes: int,
) -> None:
    """The learner, before it tells the engines about a bucket and broadcasts it: ``nbytes``
    is the size of what it broadcasts (the flattened tensor, or the tensors' sum)."""
    index = group.buckets
    group.buckets += 1
    announcement = bucket_announcement(names, dtypes, shapes, load_format, nbytes)
    key = f"{BUCKET_KEY}/{index}"
    group.store.set(key, json.dumps(announcement))
    group.store.check([key])  # a round trip: the store holds it before the engines are told
    if index:
        with contextlib.suppress(RuntimeError):  # the previous one is checked by now
            group.store.delete_key(f"{BUCKET_KEY}/{index - 1}")


def check_bucket(
    group: WeightGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    load_format: str | None,
    nbytes: int,
    wait_s: float = 2.0,
) -> None:
    """An engine, before it posts the receive of the group's next bucket: raises
    BucketMismatch unless the learner announced this bucket as the request describes it
    (``nbytes``: the bytes the request's dtypes and shapes make)."""
    index = group.buckets
    group.buckets += 1
    key = f"{BUCKET_KEY}/{index}"
    try:
        group.store.wait([key], timedelta(seconds=wait_s))
        announced = json.loads(group.store.get(key))
    except (RuntimeError, ValueError) as exc:
        raise BucketMismatch(
            f"bucket {index} of group {group.name} was not announced by the learner "
            f"({str(exc)[:120]})"
        ) from exc
    expected = bucket_announcement(names, dtypes, shapes, load_format, nbytes)
    if not isinstance(announced, dict) or announced.get("nbytes") != nbytes:
        sent = announced.get("nbytes") if isinstance(announced, dict) else announced
        raise BucketMismatch(
            f"bucket {index}: the learner broadcasts {str(sent)[:40]} bytes, the request "
            f"declares {nbytes}"
        )
    if announced.get("sha256") != expected["sha256"]:
        raise BucketMismatch(
            f"bucket {index}: the names, dtypes, shapes or format differ from what the "
            "learner announced"
        )
