"""The CPU engine as the routes see it: the model, its tokenizer and the scheduler thread.

Async methods only await: generation runs on the scheduler thread (runtime.py) and each
request's asyncio futures are resolved with ``loop.call_soon_threadsafe``; tokenising
prompts and reading a weights folder run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

import mempo
from mempo.api.engine import (
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    ModelInfo,
    ServerInfo,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsResponse,
)
from mempo.metrics import Metrics
from mempo.service import Forbidden, NotReady, inside_root, require_weights_root
from mempo.settings import quiet_hub
from mempo.weight_buckets import bucket_bytes
from mempo.weight_sync import (
    FLATTENED,
    BucketMismatch,
    JoinCancelled,
    Joining,
    WeightGroup,
    check_bucket,
)
from services.rollout.engine.model import ModelRunner, WeightsError, WeightsRootError
from services.rollout.engine.protocol import Limits, expand, response
from services.rollout.engine.runtime import EngineRuntime, EngineStopped
from services.rollout.engine.sequence import Sequence, SequenceSpec
from services.rollout.engine.settings import EngineSettings

log = logging.getLogger(__name__)
DISCONNECT_POLL_S = 1.0  # how often a long /generate checks that its client is still there
JOIN_GRACE_S = 5.0  # a newer join waits this long at most for the thread of the one it replaces


class EngineMetrics:
    """Prometheus series of the scheduler (the runtime's Observer)."""

    def __init__(self, metrics: Metrics) -> None:
        rows = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
        self.prompt_tokens = metrics.counter("prompt_tokens_total", "Prompt tokens prefilled")
        self.generated_tokens = metrics.counter("generated_tokens_total", "Tokens generated")
        self.samples = metrics.counter("samples_total", "Finished samples", ("finish",))
        self.prefill_rows = metrics.histogram("prefill_batch_rows", "Rows per prefill", rows)
        self.decode_rows = metrics.histogram("decode_batch_rows", "Rows per decode step", rows)
        self.registry = metrics.registry

    def on_prefill(self, rows: int, tokens: int) -> None:
        self.prefill_rows.observe(rows)
        self.prompt_tokens.inc(tokens)

    def on_decode(self, rows: int) -> None:
        self.decode_rows.observe(rows)

    def on_finish(self, seq: Sequence) -> None:
        self.generated_tokens.inc(len(seq.output_ids))
        self.samples.labels(str((seq.finish_reason or {}).get("type"))).inc()

    def watch(self, runtime: EngineRuntime) -> None:
        running = Gauge(
            "mempo_engine_running_requests", "Samples being decoded", registry=self.registry
        )
        waiting = Gauge("mempo_engine_waiting_requests", "Samples queued", registry=self.registry)
        running.set_function(lambda: runtime.load()[0])
        waiting.set_function(lambda: runtime.load()[1])


def _resolver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Sequence]) -> Any:
    def settle(seq: Sequence) -> None:
        if not future.done():
            future.set_result(seq)

    def on_done(seq: Sequence) -> None:  # scheduler thread
        with contextlib.suppress(RuntimeError):  # RuntimeError: the request's loop is gone
            loop.call_soon_threadsafe(settle, seq)

    return on_done


class Engine:
    def __init__(
        self,
        settings: EngineSettings,
        runner: ModelRunner,
        tokenizer: Any,
        runtime: EngineRuntime,
        limits: Limits,
    ) -> None:
        self.settings = settings
        self.runner = runner
        self.tokenizer = tokenizer
        self.runtime = runtime
        self.limits = limits
        self.tokenizer_path = str(Path(settings.tokenizer_path or runner.model_path).resolve())
        self.weight_group: WeightGroup | None = None  # the learner's group: one at most
        self._receiving = asyncio.Lock()  # one broadcast bucket at a time
        self._starting = asyncio.Lock()  # one join started at a time
        self._join: Joining | None = None  # the latest join (its thread may still run)

    @classmethod
    def load(cls, settings: EngineSettings, metrics: Metrics) -> Engine:
        """Load model and tokenizer and start the scheduler (blocking: call from a thread)."""
        import torch
        from transformers import AutoTokenizer

        quiet_hub()
        if settings.threads:
            torch.set_num_threads(settings.threads)
        model_path = settings.resolved_model_path()
        runner = ModelRunner.load(model_path, settings.dtype)
        tokenizer: Any = AutoTokenizer.from_pretrained(settings.tokenizer_path or model_path)
        context = settings.context_length or runner.max_positions or 4096
        limits = Limits(
            context,
            runner.vocab_size,
            frozenset(runner.eos_token_ids()),
            max_samples=settings.max_samples_per_request,
            max_prompt_bytes=int(context * settings.max_text_bytes_per_token),
            max_request_text_bytes=settings.max_request_text_bytes,
        )
        observer = EngineMetrics(metrics)
        runtime = EngineRuntime(
            runner,
            tokenizer,
            max_batch_size=settings.max_batch_size,
            max_wait_ms=settings.max_wait_ms,
            weight_version=settings.weight_version,
            seed=settings.seed,
            observer=observer,
            max_prefill_tokens=settings.max_prefill_tokens,
        )
        observer.watch(runtime)
        runtime.start()
        log.info(
            "CPU engine serving %s (context %d, batch %d)",
            model_path,
            context,
            settings.max_batch_size,
        )
        return cls(settings, runner, tokenizer, runtime, limits)

    def close(self) -> None:
        self.runtime.close(self.settings.drain_timeout_s)

    async def run(
        self, specs: list[SequenceSpec], gone: Callable[[], Awaitable[bool]] | None = None
    ) -> list[Sequence]:
        """Generate the samples. They are aborted if the caller is cancelled, or (polled
        every ``DISCONNECT_POLL_S``) once ``gone()`` says the client disconnected."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Sequence]] = [loop.create_future() for _ in specs]
        seqs = [
            Sequence(spec, _resolver(loop, fut)) for spec, fut in zip(specs, futures, strict=True)
        ]
        mine = {seq.spec.rid for seq in seqs}
        try:
            self.runtime.submit(seqs)
        except EngineStopped as exc:
            raise NotReady(str(exc)) from exc
        try:
            pending: set[asyncio.Future[Sequence]] = set(futures)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=DISCONNECT_POLL_S)
                if pending and gone is not None and await gone():
                    self.runtime.abort(lambda rid: rid in mine, "Abort: the client went away")
                    gone = None  # the aborted samples come back at the next step
        except asyncio.CancelledError:
            self.runtime.abort(lambda rid: rid in mine, "Abort: the request was cancelled")
            raise
        return [fut.result() for fut in futures]

    async def generate(
        self, req: GenerateRequest, gone: Callable[[], Awaitable[bool]] | None = None
    ) -> GenerateResponse | list[GenerateResponse]:
        # tokenising is CPU work: a thread, never the event loop (/health stays live)
        specs, as_list = await asyncio.to_thread(expand, req, self.tokenizer, self.limits)
        done = await self.run(specs, gone)
        responses = [response(seq) for seq in done]
        return responses if as_list else responses[0]

    async def health_generate(self) -> bool:
        """A 1-token generation within the health timeout."""
        spec = SequenceSpec(
            rid=f"health_{uuid.uuid4().hex}", prompt_ids=[0], max_new_tokens=1, temperature=0.0
        )
        try:
            await asyncio.wait_for(self.run([spec]), self.settings.health_timeout_s)
        except (asyncio.TimeoutError, NotReady):
            return False
        return True

    async def update_weights_from_disk(
        self, req: UpdateWeightsFromDiskRequest
    ) -> UpdateWeightsResponse:
        root = require_weights_root(self.settings.weights_root)  # 403 with no root at all
        path = inside_root(req.model_path, root)  # 403 outside
        try:
            state = await asyncio.to_thread(self.runner.read_weights, path, root)
            future = self.runtime.update_weights(
                state, path, req.weight_version, req.abort_all_requests
            )
            aborted = await asyncio.wrap_future(future)
        except WeightsRootError as exc:  # a file of the folder links out of the root
            log.warning("weight update from %s refused: %s", path, exc)
            raise Forbidden(str(exc)) from exc
        except (WeightsError, EngineStopped, RuntimeError) as exc:
            log.warning("weight update from %s refused: %s", path, exc)
            return UpdateWeightsResponse(success=False, message=f"Failed to update weights: {exc}")
        log.info("weights %s from %s (aborted %d requests)", req.weight_version, path, aborted)
        return UpdateWeightsResponse(success=True, message="Succeeded to update model weights.")

    async def init_weights_update_group(
        self, req: InitWeightsUpdateGroupRequest
    ) -> UpdateWeightsResponse:
        """Join the learner's weight-update group (blocks until every rank has joined).

        The join answers within ``weight_sync_timeout_s`` whatever the learner's end does
        (a port that refuses, a store that never answers). A newer join replaces one in
        progress at once (that one answers that it was replaced); once joined, the new
        group replaces the engine's group, if any: an engine is in one group at most."""
        if req.rank_offset >= req.world_size:
            return _failed(
                f"Failed to initialize custom process group: rank {req.rank_offset} is "
                f"outside a world of {req.world_size}."
            )
        async with self._starting:
            previous = self._join
            if previous is not None and previous.alive:
                previous.cancel(f"replaced by a newer join ({req.group_name})")
                if not await previous.ended(JOIN_GRACE_S):
                    return _failed(
                        "Failed to initialize custom process group: the join it replaces "
                        f"has not ended after {JOIN_GRACE_S:g}s; try again."
                    )
            joining = Joining(
                req.master_address, req.master_port, req.rank_offset, req.world_size,
                req.group_name, req.backend, self.settings.weight_sync_timeout_s,
            )  # fmt: skip
            self._join = joining
        try:
            group = await joining.wait()
        except (JoinCancelled, TimeoutError, ValueError, RuntimeError, OSError) as exc:
            # torch's DistError is a RuntimeError
            log.warning("joining weight-update group %s failed: %s", req.group_name, exc)
            return _failed(f"Failed to initialize custom process group: {str(exc)[:300]}.")
        replaced, self.weight_group = self.weight_group, group
        if replaced is not None:
            log.info("weight-update group %s left for %s", replaced.name, group.name)
        log.info(
            "joined weight-update group %s at %s:%d as rank %d of %d (%s)", req.group_name,
            req.master_address, req.master_port, req.rank_offset, req.world_size, req.backend,
        )  # fmt: skip
        return UpdateWeightsResponse(success=True, message="Succeeded to initialize custom process group.")

    def _group(self, name: str) -> WeightGroup | None:
        group = self.weight_group
        return group if group is not None and group.name == name else None

    def _leave(self, group: WeightGroup) -> None:
        """Leave ``group`` (if it is still this engine's): its connections close, so a
        learner still sending in it fails at once, and no later receive can be paired
        with a send this engine did not receive."""
        if self.weight_group is group:
            self.weight_group = None

    async def update_weights_from_distributed(
        self, req: UpdateWeightsFromDistributedRequest
    ) -> UpdateWeightsResponse:
        """Receive one bucket the learner broadcasts and load it between steps (SGLang: the
        update waits for running requests unless paused or ``abort_all_requests``).

        Before the receive is posted, the bucket must fit the model and match what the
        learner announced in the group's store (its bytes, a digest of the request): a
        bucket refused then, or one whose receive fails, makes the engine leave the group
        (the learner makes a new one); the weights are unchanged."""
        group = self._group(req.group_name)
        if group is None:
            held = [] if self.weight_group is None else [self.weight_group.name]
            return _failed(
                f"Group {req.group_name} not in {held}. "
                "Please call `init_weights_update_group` first."
            )
        flattened = req.load_format == FLATTENED
        async with self._receiving:
            if self._group(req.group_name) is not group:
                return _failed(f"Group {req.group_name} was left or replaced.")
            try:  # checked before receiving: nothing unknown is allocated
                dtypes = self.runner.bucket_dtypes(req.names, req.dtypes, req.shapes)
                size = bucket_bytes(dtypes, req.shapes)
                await asyncio.to_thread(
                    check_bucket, group, req.names, req.dtypes, req.shapes, req.load_format,
                    size, min(2.0, self.settings.weight_sync_timeout_s),
                )  # fmt: skip
            except (WeightsError, BucketMismatch) as exc:
                self._leave(group)
                log.warning("broadcast bucket refused, group %s left: %s", group.name, exc)
                return _failed(f"Failed to update weights: {exc} (group {group.name} left)")
            try:
                state = await asyncio.to_thread(
                    self.runner.receive_bucket, group, req.names, dtypes, req.shapes, flattened
                )
            except (WeightsError, RuntimeError) as exc:  # gloo's errors are RuntimeErrors
                if not isinstance(exc, WeightsError):  # received, but not finite: in step
                    self._leave(group)
                log.warning("broadcast weight update refused: %s", exc)
                return _failed(f"Failed to update weights: {exc}")
            try:
                future = self.runtime.update_weights(
                    state, None, req.weight_version, req.abort_all_requests
                )
                await asyncio.wrap_future(future)
            except (WeightsError, EngineStopped, RuntimeError) as exc:
                log.warning("broadcast weight update refused: %s", exc)
                return _failed(f"Failed to update weights: {exc}")
        log.info(
            "received %d tensors by broadcast (weight version %s)", len(state),
            self.runtime.weight_version,
        )  # fmt: skip
        return UpdateWeightsResponse(success=True, message="Succeeded to update model weights.")

    async def destroy_weights_update_group(
        self, req: DestroyWeightsUpdateGroupRequest
    ) -> UpdateWeightsResponse:
        group = self._group(req.group_name)
        if group is None:
            return _failed("The group to be destroyed does not exist.")
        self._leave(group)
        return UpdateWeightsResponse(success=True, message="Succeeded to destroy custom process group.")

    async def pause(self, mode: str) -> None:
        await asyncio.wrap_future(self.runtime.pause(mode))

    def idle(self) -> bool:
        return self.runtime.load() == (0, 0)

    def model_info(self) -> ModelInfo:
        config = self.runner.model.config
        return ModelInfo.model_validate(
            {
                "model_path": str(self.runner.model_path),
                "tokenizer_path": self.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.runtime.weight_version,
                "served_model_name": str(self.settings.model_path or self.runner.model_path),
                "model_type": getattr(config, "model_type", None),
                "architectures": getattr(config, "architectures", None),
            }
        )

    def server_info(self) -> ServerInfo:
        running, waiting = self.runtime.load()
        state = {**asdict(self.runtime.stats), "running": running, "waiting": waiting}
        return ServerInfo.model_validate(
            {
                "model_path": str(self.runner.model_path),
                "tokenizer_path": self.tokenizer_path,
                "context_length": self.limits.context_length,
                "max_batch_size": self.settings.max_batch_size,
                "weight_version": self.runtime.weight_version,
                "version": f"mempo-cpu-engine {mempo.__version__}",
                "internal_states": [state],
                "max_req_input_len": self.limits.context_length - 1,
                "max_wait_ms": self.settings.max_wait_ms,
                "dtype": self.settings.dtype,
                "device": "cpu",
                "paused": self.runtime.paused,
            }
        )


def _failed(message: str) -> UpdateWeightsResponse:
    return UpdateWeightsResponse(success=False, message=message)
