"""Loading the scoring model, and swapping it atomically when new weights arrive.

CUDA when available (bf16), else CPU (fp32, SDPA attention). A weight update builds the
new model beside the old one and swaps the reference; the batcher reads the reference
once per batch, so a batch in flight finishes on the weights it started with.

An update reads nothing but the folder's ``*.safetensors``, through mempo.weights: each
file must resolve inside the weights root, and the tensors must be exactly the model's
(no missing, unexpected or reshaped tensor, no NaN / inf), as the CPU engine requires.
They become the parameters of a new model built from the current one (its structure
copied, its parameters not: on CPU the tensors read from the files are the parameters,
elsewhere one copy to the device); no parameter is ever a view of a file's mapping, so a
file rewritten or truncated after its load changes nothing scored. The architecture,
config and tokenizer stay the ones the scorer started with (a weight update changes
weights only).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mempo.model_weights import assign_weights, module_tree_copy, own_tensors
from mempo.weights import load_checked

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model, its tokenizer and the weight version they are; never mutated."""

    model: Any
    tokenizer: Any
    path: str
    version: str
    device: torch.device
    tokenizer_path: str | None = None  # default: path (a weight update keeps the tokenizer)

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad) if pad is not None else 0

    @property
    def max_positions(self) -> int | None:
        value = getattr(self.model.config, "max_position_embeddings", None)
        return int(value) if value else None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_model(path: str | Path, version: str, device: str = "auto") -> LoadedModel:
    """An HF causal LM folder -> eval-mode model (bf16 on CUDA, fp32 on CPU) + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = resolve_device(device)
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(path)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.to(target).eval()
    own_tensors(model)  # on CPU: not views of the mapped files, which may be rewritten or cut
    model.requires_grad_(False)
    log.info("loaded %s (weight version %s) on %s as %s", path, version, target, dtype)
    return LoadedModel(model, tokenizer, str(path), version, target)


def load_initial(model_path: str | None, version: str, device: str = "auto") -> LoadedModel:
    """The configured model, or the tiny one (built locally once) when none is set."""
    from mempo_sim.tiny import default_cache_dir, ensure_tiny

    return load_model(model_path or ensure_tiny(default_cache_dir()), version, device)


class ModelHolder:
    """The current ``LoadedModel``; ``swap`` replaces it, readers take a snapshot."""

    def __init__(self, initial: LoadedModel) -> None:
        self._current = initial
        self._lock = threading.Lock()
        self.update_lock = threading.Lock()  # one weight update at a time

    @property
    def current(self) -> LoadedModel:
        with self._lock:
            return self._current

    def swap(self, new: LoadedModel) -> LoadedModel:
        with self._lock:
            old, self._current = self._current, new
        return old

    def update(self, path: str | Path, version: str, root: Path) -> LoadedModel:
        """Load the weights in ``path`` (every file inside ``root``) into a copy of the
        current model and make it current (blocking; call from a thread). Raises
        mempo.weights.WeightsFormatError (WeightsOutsideRoot, NonFiniteWeights) when the
        folder does not fit the model; the current model is untouched then."""
        with self.update_lock:
            current = self.current
            expected = current.model.state_dict()
            state = load_checked(Path(path), expected, root)
            # A new tree of modules over the serving one's tensors, which assign_weights
            # then replaces: no copy of the weights beyond their read (the tensors read
            # become the parameters on CPU; one copy to the device and dtype elsewhere).
            # The serving model is untouched until the swap.
            model = module_tree_copy(current.model)
            assign_weights(model, {
                name: tensor.to(device=expected[name].device, dtype=expected[name].dtype)
                for name, tensor in state.items()
            })  # fmt: skip
            new = LoadedModel(
                model,
                current.tokenizer,
                str(path),
                version,
                current.device,
                current.tokenizer_path or current.path,
            )
            self.swap(new)
        if new.device.type == "cuda":
            torch.cuda.empty_cache()
        return new
