"""One sample being generated: its request, its tokens so far, and when it stops.

Stop rules follow SGLang's order (``Req.check_finished``): ``max_new_tokens`` first
(finish ``{"type": "length", "length": N}``), then a stop token (EOS unless
``ignore_eos``, and ``stop_token_ids``: ``{"type": "stop", "matched": id}``), then a stop
string found in the decoded tail (``{"type": "stop", "matched": "</search>"}``).
``output_ids`` keep every generated token; ``text`` drops a matched stop token and is cut
where a matched stop string starts, as SGLang's detokenizer does (unless no_stop_trim).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from services.rollout.engine.sampling import RowParams


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class SequenceSpec:
    """What one sample asks for (a request with n > 1 or a batch makes several)."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input log-probs

    def logits_needed(self) -> int:
        """Prefill positions whose logits this sample needs (its input log-probs + 1)."""
        start = self.logprob_start_len
        if self.return_logprob and 0 <= start < len(self.prompt_ids):
            return len(self.prompt_ids) - start
        return 1


class Sequence:
    """Mutable generation state, owned by the scheduler thread once admitted."""

    def __init__(self, spec: SequenceSpec, on_done: Callable[[Sequence], None]) -> None:
        self.spec = spec
        self.on_done = on_done
        self.submitted_at = time.monotonic()
        self.finished_at: float | None = None
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.input_logprobs: list[float | None] = []
        self.finish_reason: dict[str, Any] | None = None
        self.text = ""
        self.weight_version = ""
        self.abort_message: str | None = None  # set by another thread to abort
        generator = None
        if spec.seed is not None:
            generator = torch.Generator().manual_seed(spec.seed)
        self.row = RowParams(spec.temperature, spec.top_p, spec.top_k, generator)
        self._tail_tokens = max((len(s) for s in spec.stop), default=0) + 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def e2e_latency(self) -> float:
        return (self.finished_at or time.monotonic()) - self.submitted_at

    def append(self, token: int, logprob: float, tokenizer: Detokenizer) -> dict[str, Any] | None:
        """Record a generated token; the finish reason if the sample is now done."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        spec = self.spec
        if len(self.output_ids) >= spec.max_new_tokens:
            return {"type": "length", "length": spec.max_new_tokens}
        if token in spec.stop_token_ids:
            return {"type": "stop", "matched": token}
        if spec.stop:
            tail = tokenizer.decode(
                self.output_ids[-self._tail_tokens :], skip_special_tokens=False
            )
            for stop in spec.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None

    def finish(self, reason: dict[str, Any], tokenizer: Detokenizer) -> None:
        """Set the final text and hand the sample back (once)."""
        if self.finished:
            return
        matched = reason.get("matched")
        trim = not self.spec.no_stop_trim
        ids = self.output_ids[:-1] if trim and isinstance(matched, int) else self.output_ids
        text = tokenizer.decode(ids, skip_special_tokens=self.spec.skip_special_tokens)
        if trim and isinstance(matched, str) and (cut := text.find(matched)) != -1:
            text = text[:cut]
        self.text = text
        self.finish_reason = reason
        self.finished_at = time.monotonic()
        self.on_done(self)
