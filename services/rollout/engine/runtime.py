"""The scheduler thread: a request queue in front of the Decoder (continuous batching).

Requests wait in a queue; between decode steps the scheduler admits waiting ones (once
the free slots are filled or the oldest has waited ``max_wait_ms``) and the Decoder
prefills them as a group and merges them into the running batch. Short and long
samples share the engine without waiting for each other.

Control calls (abort, pause, weight updates, shutdown) come from other threads; they
set state under one lock and the scheduler acts on it between steps, never mid-forward:
- a weight update stops admission, waits for the running rows to finish (or aborts
  them with ``abort_all_requests``; a paused engine applies it at once), then swaps;
- pause ``abort`` aborts everything in flight; ``in_place``/``retract`` keep the running
  rows (this engine has no KV pool to retract from) and stop stepping; requests sent
  while paused wait until ``resume``.
The model and the batch tensors are only ever touched by the scheduler thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from mempo.service import ServiceError
from services.rollout.engine.decoding import Decoder, Observer, RuntimeStats
from services.rollout.engine.model import ModelRunner
from services.rollout.engine.sequence import Detokenizer, Sequence

log = logging.getLogger(__name__)


def every(rid: str) -> bool:
    """Matches every request id."""
    return True


class EngineStopped(Exception):
    """The engine is shutting down and takes no more requests."""


class DuplicateRequestId(ServiceError):
    """A request id already waiting or running (SGLang's 400 "Duplicate request ID
    detected"): an id stays taken until its request finishes or is aborted."""

    status_code = 400


@dataclass
class PendingUpdate:
    state: dict[str, torch.Tensor]
    path: Path | None  # None: a broadcast bucket
    version: str | None
    aborted: int  # requests aborted to make way for it
    future: Future[int]


class EngineRuntime:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Detokenizer,
        *,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        weight_version: str = "0",
        seed: int = 0,
        observer: Observer | None = None,
        max_prefill_tokens: int = 16384,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self._cv = threading.Condition()
        self.decoder = Decoder(
            runner, tokenizer, self._cv, weight_version, seed, observer, max_prefill_tokens
        )
        self._waiting: deque[Sequence] = deque()
        self._admitting: list[Sequence] = []  # taken from the queue, being prefilled
        self._paused = False
        self._acks: list[Future[None]] = []
        self._update: PendingUpdate | None = None
        self._stopping = False
        self._drain_deadline = 0.0
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)

    # ------------------------------------------------------------------ other threads

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def weight_version(self) -> str:
        return self.decoder.weight_version

    @property
    def stats(self) -> RuntimeStats:
        return self.decoder.stats

    def load(self) -> tuple[int, int]:
        """(running, waiting) sequences."""
        with self._cv:
            return len(self.decoder.seqs), len(self._waiting) + len(self._admitting)

    def submit(self, seqs: Iterable[Sequence]) -> None:
        """Queue the sequences; DuplicateRequestId if a rid is taken (all or none queued)."""
        seqs = list(seqs)
        with self._cv:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            # A finished sequence's rid is free even while the scheduler still holds it
            # (its answer may already be sent: the same rid can come right back).
            active = (*self._waiting, *self._admitting, *self.decoder.seqs)
            taken = {s.spec.rid for s in active if not s.finished}
            for seq in seqs:
                if seq.spec.rid in taken:
                    raise DuplicateRequestId(f"Duplicate request ID detected: {seq.spec.rid}")
                taken.add(seq.spec.rid)
            self._waiting.extend(seqs)
            self._cv.notify()

    def abort(self, match: Callable[[str], bool], message: str = "Abort requested") -> int:
        """Abort every waiting or running sequence whose rid matches; how many."""
        with self._cv:
            count = self._mark_aborted(match, message)
            self._cv.notify()
            return count

    def pause(self, mode: str) -> Future[None]:
        """Stop stepping; resolved once the scheduler is between steps."""
        ack: Future[None] = Future()
        with self._cv:
            self._paused = True
            if mode == "abort":
                self._mark_aborted(every, "Abort by pause_generation")
            self._acks.append(ack)
            self._cv.notify()
        return ack

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify()

    def update_weights(
        self, state: dict[str, torch.Tensor], path: Path | None, version: str | None, abort_all: bool
    ) -> Future[int]:
        """Swap weights once no request runs on the old ones; resolves to the aborted count."""
        future: Future[int] = Future()
        with self._cv:
            aborted = self._mark_aborted(every, "Abort by weight update") if abort_all else 0
            if self._update is not None:
                self._update.future.set_exception(RuntimeError("superseded by a newer update"))
            self._update = PendingUpdate(state, path, version, aborted, future)
            self._cv.notify()
        return future

    def close(self, drain_timeout_s: float = 10.0) -> None:
        """Stop intake, let running rows finish for ``drain_timeout_s``, abort the rest, join."""
        with self._cv:
            self._stopping = True
            self._paused = False
            self._drain_deadline = time.monotonic() + drain_timeout_s
            self._mark_aborted(every, "Abort: engine shutting down", running=False)
            self._cv.notify()
        self._thread.join(timeout=drain_timeout_s + 30.0)

    def _mark_aborted(
        self, match: Callable[[str], bool], message: str, running: bool = True
    ) -> int:
        active = (*self._admitting, *self.decoder.seqs) if running else ()
        count = 0
        for seq in [*self._waiting, *active]:
            if seq.abort_message is None and match(seq.spec.rid):
                seq.abort_message = message
                count += 1
        return count

    # ------------------------------------------------------------------ scheduler thread

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while (admitted := self._next_work()) is not None:
                    try:
                        self._step(admitted)
                    except Exception as exc:  # a bug: fail the batch, keep serving
                        log.exception("engine step failed; aborting the running requests")
                        self.decoder.abort_all(self._admitting, f"engine error: {exc}")
                    with self._cv:
                        self._admitting = []
        finally:
            self._stopped()

    def _step(self, admitted: list[Sequence]) -> None:
        self.decoder.finish_aborted()
        self._apply_pending_update()
        if admitted:
            self.decoder.prefill(admitted)
        if self.decoder.seqs and not self._paused:
            self.decoder.step()

    def _stopped(self) -> None:
        """Leave nobody waiting: fail a pending update, release pauses, abort leftovers."""
        with self._cv:
            self._stopping = True
            if self._update is not None:
                self._update.future.set_exception(EngineStopped("the engine stopped"))
                self._update = None
            self._release_acks()
            leftovers = [*self._waiting, *self._admitting]
            self._waiting.clear()
        self.decoder.abort_all(leftovers, "the engine stopped")
        log.info("engine scheduler stopped")

    def _release_acks(self) -> None:
        for ack in self._acks:
            ack.set_result(None)
        self._acks.clear()

    def _next_work(self) -> list[Sequence] | None:
        """Block until there is something to do; the sequences to admit now (maybe none).

        None: the engine has stopped and nothing is left."""
        with self._cv:
            while True:
                self._reap_waiting()
                running = self.decoder.seqs
                aborted = any(seq.abort_message for seq in running)
                if not aborted:  # pause(abort) returns once its aborts are done
                    self._release_acks()
                if self._stopping:
                    if time.monotonic() >= self._drain_deadline:
                        self._mark_aborted(every, "Abort: engine shutting down")
                    if not running:
                        return None
                admitted, wait_s = self._admission()
                if admitted:
                    return admitted
                busy = running and not self._paused
                can_update = self._update is not None and (not running or self._paused)
                if busy or aborted or can_update:
                    return []
                self._cv.wait(timeout=wait_s)

    def _admission(self) -> tuple[list[Sequence], float | None]:
        """Waiting sequences to admit now, else how long to wait before asking again."""
        if not self._waiting or self._paused or self._update is not None or self._stopping:
            return [], 1.0
        free = self.max_batch_size - len(self.decoder.seqs)
        if free <= 0:
            return [], None
        age = time.monotonic() - self._waiting[0].submitted_at
        if len(self._waiting) < free and age < self.max_wait_s:
            return [], self.max_wait_s - age
        self._admitting = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        return self._admitting, None

    def _reap_waiting(self) -> None:
        kept: deque[Sequence] = deque()
        for seq in self._waiting:
            if seq.abort_message is not None:
                self.decoder.finish(seq, {"type": "abort", "message": seq.abort_message})
            else:
                kept.append(seq)
        self._waiting = kept

    def _apply_pending_update(self) -> None:
        with self._cv:
            update = self._update
            if update is None or (self.decoder.seqs and not self._paused):
                return
            self._update = None
        try:
            self.decoder.load_weights(update.state, update.path, update.version)
        except Exception as exc:
            log.exception("weight update from %s failed", update.path)
            update.future.set_exception(exc)
            return
        update.future.set_result(update.aborted)
