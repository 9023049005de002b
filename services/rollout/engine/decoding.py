"""The model side of the scheduler: the sequences being decoded and their batch tensors.

One forward pass per step for every running row; a freshly prefilled group joins the
running batch between steps (continuous batching), finished rows leave it at once.
Only the scheduler thread calls these methods; changes to ``seqs`` happen under the
runtime's lock so that other threads may read it (to mark aborts).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from services.rollout.engine.batch import RunningBatch, prompt_logprobs
from services.rollout.engine.model import ModelRunner
from services.rollout.engine.sampling import SamplingRows, sample_next
from services.rollout.engine.sequence import Detokenizer, Sequence

log = logging.getLogger(__name__)


class Observer(Protocol):
    def on_prefill(self, rows: int, tokens: int) -> None: ...
    def on_decode(self, rows: int) -> None: ...
    def on_finish(self, seq: Sequence) -> None: ...


@dataclass
class RuntimeStats:
    prefill_batches: int = 0
    decode_steps: int = 0
    max_prefill_batch: int = 0
    max_decode_batch: int = 0
    generated_tokens: int = 0
    finished: int = 0


class Decoder:
    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Detokenizer,
        lock: threading.Condition,
        weight_version: str,
        seed: int = 0,
        observer: Observer | None = None,
        max_prefill_tokens: int = 16384,
    ) -> None:
        self.runner = runner
        self.max_prefill_tokens = max_prefill_tokens
        self.tokenizer = tokenizer
        self.weight_version = weight_version
        self.observer = observer
        self.stats = RuntimeStats()
        self.seqs: list[Sequence] = []  # the rows of _batch, in order
        self._lock = lock
        self._batch: RunningBatch | None = None
        self._rows: SamplingRows | None = None
        self._shared_generator = torch.Generator().manual_seed(seed)

    def finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        seq.weight_version = seq.weight_version or self.weight_version
        seq.finish(reason, self.tokenizer)
        self.stats.finished += 1
        if self.observer is not None:
            self.observer.on_finish(seq)

    def load_weights(
        self, state: dict[str, torch.Tensor], path: Path | None, version: str | None
    ) -> None:
        """Swap the model's weights (only while no row runs, or paused)."""
        self.runner.apply_weights(state, path)
        if version is not None:
            self.weight_version = version

    def finish_aborted(self) -> None:
        done = [i for i, seq in enumerate(self.seqs) if seq.abort_message is not None]
        for i in done:
            self.finish(self.seqs[i], {"type": "abort", "message": self.seqs[i].abort_message})
        if done:
            self._drop(done)

    def abort_all(self, seqs: list[Sequence], message: str) -> None:
        """Finish ``seqs`` (being admitted) and every running row with an abort."""
        for seq in [*seqs, *self.seqs]:
            if not seq.finished:
                self.finish(seq, {"type": "abort", "message": message})
        self._drop(list(range(len(self.seqs))))

    def prefill(self, seqs: list[Sequence]) -> None:
        """Run the new sequences' prompts in chunks of at most ``max_prefill_tokens`` padded
        tokens (a longer prompt alone), sample their first tokens, join the batch. Between
        chunks, sequences aborted meanwhile (their client left) are finished unrun: a
        maximal admission stops within one chunk, not after the whole prefill."""
        chunk: list[Sequence] = []
        for seq in seqs:
            longest = max(len(s.spec.prompt_ids) for s in [*chunk, seq])
            if chunk and longest * (len(chunk) + 1) > self.max_prefill_tokens:
                self._prefill_live(chunk)
                chunk = []
            chunk.append(seq)
        self._prefill_live(chunk)

    def _prefill_live(self, seqs: list[Sequence]) -> None:
        live = []
        for seq in seqs:
            if seq.abort_message is not None:
                self.finish(seq, {"type": "abort", "message": seq.abort_message})
            else:
                live.append(seq)
        if live:
            self._prefill(live)

    def _prefill(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.weight_version = self.weight_version
        keep = max(seq.spec.logits_needed() for seq in seqs)
        try:
            batch, logits = RunningBatch.prefill(
                self.runner, [seq.spec.prompt_ids for seq in seqs], keep
            )  # logits (B, keep, V)
        except Exception as exc:
            log.exception("prefill of %d sequences failed", len(seqs))
            self.abort_all(seqs, f"prefill failed: {exc}")
            return
        for row, seq in enumerate(seqs):
            start = seq.spec.logprob_start_len
            if seq.spec.return_logprob and 0 <= start < len(seq.spec.prompt_ids):
                seq.input_logprobs = prompt_logprobs(logits[row], seq.spec.prompt_ids, start)
            if seq.spec.max_new_tokens == 0:  # prefill only (scoring)
                self.finish(seq, {"type": "length", "length": 0})
        self.stats.prefill_batches += 1
        self.stats.max_prefill_batch = max(self.stats.max_prefill_batch, len(seqs))
        if self.observer is not None:
            self.observer.on_prefill(len(seqs), int(batch.mask.sum()))
        rows = SamplingRows.build([seq.row for seq in seqs], self.runner.vocab_size)
        batch.last, chosen = sample_next(logits[:, -1], rows, self._shared_generator)
        self._join(batch, seqs, chosen)

    def _join(self, batch: RunningBatch, seqs: list[Sequence], chosen: torch.Tensor) -> None:
        """Record the first sampled tokens, then merge the rows still going into the batch."""
        live = [i for i, seq in enumerate(seqs) if not seq.finished]
        done = self._append([seqs[i] for i in live], batch.last[live], chosen[live])
        live = [i for j, i in enumerate(live) if j not in done]
        if not live:
            return
        if len(live) < len(seqs):
            batch.select(live)
        with self._lock:
            if self._batch is None:
                self._batch = batch
            else:
                self._batch.merge(batch)
            self.seqs.extend(seqs[i] for i in live)
        self._rebuild_rows()

    def step(self) -> None:
        """One decode step for every running row."""
        assert self._batch is not None and self._rows is not None
        try:
            logits = self._batch.decode(self.runner)  # (B, V)
        except Exception as exc:
            log.exception("decode step of %d rows failed", self._batch.size)
            self.abort_all([], f"decode failed: {exc}")
            return
        self._batch.last, chosen = sample_next(logits, self._rows, self._shared_generator)
        self.stats.decode_steps += 1
        self.stats.max_decode_batch = max(self.stats.max_decode_batch, len(self.seqs))
        if self.observer is not None:
            self.observer.on_decode(len(self.seqs))
        done = self._append(self.seqs, self._batch.last, chosen)
        if done:
            self._drop(sorted(done))

    def _append(self, seqs: list[Sequence], tokens: torch.Tensor, chosen: torch.Tensor) -> set[int]:
        """Add one token to each sequence; the indices that finished."""
        done: set[int] = set()
        pairs = zip(tokens.tolist(), chosen.tolist(), strict=True)
        for i, (seq, (token, logprob)) in enumerate(zip(seqs, pairs, strict=True)):
            reason = seq.append(token, logprob, self.tokenizer)
            if reason is not None:
                self.finish(seq, reason)
                done.add(i)
        self.stats.generated_tokens += len(seqs)
        return done

    def _drop(self, rows: list[int]) -> None:
        """Remove finished rows from the running batch."""
        gone = set(rows)
        keep = [i for i in range(len(self.seqs)) if i not in gone]
        with self._lock:
            self.seqs = [self.seqs[i] for i in keep]
            if not keep:
                self._batch = None
            elif self._batch is not None:
                self._batch.select(keep)
        self._rebuild_rows()

    def _rebuild_rows(self) -> None:
        rows = [seq.row for seq in self.seqs]
        self._rows = SamplingRows.build(rows, self.runner.vocab_size) if rows else None
