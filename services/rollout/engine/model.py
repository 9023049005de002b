"""The transformers model behind the CPU engine: loading, one forward, weight swaps.

Only the scheduler thread calls ``forward`` and ``apply_weights``; ``read_weights`` runs
in a request thread, so a bad folder is refused before the engine stops taking work.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import torch

from mempo.model_weights import assign_weights, own_tensors
from mempo.service import without_root
from mempo.weight_buckets import empty_bucket, parse_dtype, unflatten
from mempo.weight_sync import broadcast
from mempo.weights import WeightsOutsideRoot, check_finite, load_checked

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WeightsError(Exception):
    """A weights folder that cannot be loaded into this model."""


class WeightsRootError(WeightsError):
    """A weights file that resolves outside the weights root."""


class ModelRunner:
    """A causal LM in eval mode with the few calls the scheduler needs."""

    def __init__(self, model: Any, model_path: Path) -> None:
        self.model = model
        self.model_path = model_path
        params = inspect.signature(model.forward).parameters
        # transformers 5.x names the KV cache ``cache``; 4.x named it ``past_key_values``.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 0)

    @classmethod
    def load(cls, model_path: Path, dtype: str = "float32") -> ModelRunner:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])
        own_tensors(model)  # not views of the mapped files: those may be rewritten or cut
        model.eval()
        model.requires_grad_(False)
        return cls(model, model_path)

    def eos_token_ids(self) -> set[int]:
        """EOS ids from the generation config (or the model config), as SGLang reads them."""
        ids: set[int] = set()
        for config in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(config, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(e) for e in eos)
        return ids

    def new_cache(self) -> Any:
        """An empty cache of plain (full attention) layers, so rows can be padded and merged."""
        from transformers import DynamicCache

        return DynamicCache()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        keep: int = 1,
    ) -> torch.Tensor:
        """Logits of the last ``keep`` positions, (B, keep, V); ``cache`` grows in place."""
        kwargs = {self._cache_kw: cache}
        out = self.model(
            input_ids=input_ids,  # (B, T)
            attention_mask=attention_mask,  # (B, L + T), 0 on left padding
            position_ids=position_ids,  # (B, T)
            use_cache=True,
            logits_to_keep=keep,
            **kwargs,
        )
        return out.logits  # type: ignore[no-any-return]

    def read_weights(self, path: Path, root: Path | None) -> dict[str, torch.Tensor]:
        """Read the safetensors in ``path`` (each file inside ``root``) and check them
        against this model's parameters (mempo.weights.load_checked: names, shapes,
        finite values unless the learner's seal vouches for them)."""
        try:
            is_folder = path.is_dir()
        except OSError:  # a name longer than the file system allows
            is_folder = False
        if not is_folder:
            raise WeightsError(without_root(f"{path} is not a folder", root))
        expected = self.model.state_dict()
        try:  # read into tensors of their own (mempo/weights.py): no view of the files
            state = load_checked(path, expected, root)
        except WeightsOutsideRoot as exc:
            raise WeightsRootError(str(exc)) from exc
        except (OSError, ValueError, RuntimeError) as exc:
            raise WeightsError(without_root(f"cannot load {path}: {exc}", root)) from exc
        return {name: tensor.to(expected[name].dtype) for name, tensor in state.items()}

    def bucket_dtypes(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> list[torch.dtype]:
        """Check a broadcast bucket's description against this model before receiving it
        (known names, once each, the model's shapes, floating dtypes); its dtypes."""
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightsError(
                f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
                f"{len(shapes)})"
            )
        if len(set(names)) != len(names):
            raise WeightsError("a tensor is named twice in one bucket")
        expected = self.model.state_dict()
        parsed = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if name not in expected:
                raise WeightsError(f"unexpected tensor {name[:200]!r}")
            if list(expected[name].shape) != list(shape):
                raise WeightsError(
                    f"{name}: shape {shape[:8]}, the model has {list(expected[name].shape)}"
                )
            try:
                parsed.append(parse_dtype(dtype))
            except ValueError as exc:
                raise WeightsError(str(exc)[:200]) from exc
            if not parsed[-1].is_floating_point:
                raise WeightsError(f"{name}: dtype {dtype} is not a floating dtype")
        return parsed

    def receive_bucket(
        self,
        group: Any,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[list[int]],
        flattened: bool,
    ) -> dict[str, torch.Tensor]:
        """Receive one broadcast bucket (described by ``bucket_dtypes``' checks) and check
        its values; the tensors in the model's dtypes."""
        if flattened:  # one collective for the bucket
            buffer = empty_bucket(dtypes, shapes)
            broadcast(group, buffer)
            try:
                tensors = unflatten(buffer, names, dtypes, shapes)
            except ValueError as exc:
                raise WeightsError(str(exc)) from exc
        else:  # one collective per tensor, in order
            tensors = {}
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                tensors[name] = torch.empty(shape, dtype=dtype)
                broadcast(group, tensors[name])
        try:
            check_finite(tensors, "the broadcast bucket")
        except ValueError as exc:
            raise WeightsError(str(exc)) from exc
        expected = self.model.state_dict()
        return {name: tensor.to(expected[name].dtype) for name, tensor in tensors.items()}

    def apply_weights(self, state: dict[str, torch.Tensor], path: Path | None) -> None:
        """Put checked weights in the model (scheduler thread, between steps); ``path``:
        the folder they came from (None: a broadcast bucket, maybe a part of the model).

        The tensors are assigned, not copied (read from the files or the received bucket,
        they own their memory); tied weights (lm_head = embeddings) are tied again to
        whichever of them ``state`` holds."""
        assign_weights(self.model, state)
        if path is not None:
            self.model_path = path
        log.info("loaded %d tensors from %s", len(state), path or "a broadcast")
