"""A tiny Qwen2 causal LM and its tokenizer, built entirely locally (no hub).

The tokenizer is a byte-level BPE trained on the synthetic world's text with Qwen2's
exact pipeline (NFC, Qwen2's split regex, ByteLevel without regex), so the ids survive a
reload by ``AutoTokenizer`` (transformers 5 rebuilds a qwen2 tokenizer's pipeline on
load). The agent's tags are added as single, non-special tokens (special ones would be
stripped by ``skip_special_tokens``). The model is a randomly initialised
``Qwen2ForCausalLM``; both are deterministic from the seeds and saved in HF format.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mempo.files import atomic_dir

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2's pre-tokenizer split (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


RECIPE_VERSION = 6  # bump when the build recipe changes, so cached models are rebuilt


@dataclass(frozen=True)
class TinyConfig:
    """Shape of the tiny policy; the defaults (about 1M parameters) keep tests fast."""

    hidden_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 2048
    max_positions: int = 8192
    seed: int = 0
    world_seed: int = 0
    pretrain_steps: int = 0  # reading-drill pretraining (mempo_sim/pretrain.py); 0: random weights
    pretrain_worlds: int = 32

    def key(self, texts: list[str] | None = None) -> str:
        """Cache key: the shape, the recipe and the text the tokenizer learns from (so a
        change to the world or the oracle's format gives a new model, not a stale one)."""
        digest = hashlib.sha256()
        digest.update(json.dumps({**asdict(self), "recipe": RECIPE_VERSION}, sort_keys=True).encode())
        for text in texts if texts is not None else training_texts(self.world_seed):
            digest.update(text.encode())
            digest.update(b"\0")
        return digest.hexdigest()[:12]


PRESETS: dict[str, TinyConfig] = {
    # Random weights: the tests' model (built in seconds).
    "test": TinyConfig(),
    # The demo's and the learning proof's base: the same network after 1,200 steps of
    # reading drills (mempo_sim/pretrain.py, about 4 minutes on 2 cores; docs/results.md).
    "reader": TinyConfig(pretrain_steps=1200),
}


def training_texts(world_seed: int = 0) -> list[str]:
    """Text the tokenizer learns from: the world's search results, questions and oracle
    rounds, and the name inventory that makes every pool name one token."""
    from mempo.agent_format import INSTRUCTIONS, format_documents
    from mempo_sim.oracle import Oracle
    from mempo_sim.world import World, WorldConfig

    world = World.generate(WorldConfig(seed=world_seed))
    by_title = {p["contents"].split("\n", 1)[0]: p for p in world.passages}

    def lookup(query: str) -> str:
        # Exact title lookup plus two fixed neighbours: independent of any search engine,
        # so the tokenizer (and the cache key) only change with the world.
        row = int(by_title[query]["id"]) if query in by_title else 0
        docs = [world.passages[(row + i) % len(world.passages)] for i in range(3)]
        return format_documents(docs)

    oracle = Oracle(world)
    texts = [
        INSTRUCTIONS,
        *(format_documents([p]) for p in world.passages),
        *(q.text for q in world.questions),
    ]
    for k in (1, 3):
        for questions, _ in world.tasks("train", k, 40, seed=k):
            for mode in ("memory", "full"):
                for r in oracle.episode(questions, lookup, mode):
                    texts.append(r.response)
                    if r.information:
                        texts.append(r.information)
    return [*texts, _name_inventory()]


def _name_inventory(repeats: int = 200) -> str:
    """Every pool name, space first as the world always writes it, often enough that BPE
    merges each into one token before it spends merges on rarer English."""
    from mempo_sim.lexicon import NAMES

    return "".join(f" {name}" for name in NAMES) * repeats


def check_name_tokens(tokenizer: Any) -> None:
    """Every pool name, as written (after a space), must be exactly one token."""
    from mempo_sim.lexicon import NAMES

    split = [n for n in NAMES if len(tokenizer.encode(f" {n}", add_special_tokens=False)) != 1]
    if split:
        raise RuntimeError(f"{len(split)} pool names are not one token (e.g. {split[:5]}): raise vocab_size")


def build_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """Train the BPE and wrap it as a transformers fast tokenizer."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    from mempo.agent_format import DEFAULT_TAGS

    tok = Tokenizer(
        models.BPE(
            unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in DEFAULT_TAGS.all_tags()]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_tiny(out_dir: str | Path, config: TinyConfig | None = None, texts: list[str] | None = None) -> Path:
    """Write tokenizer + randomly initialised Qwen2ForCausalLM (HF format) to ``out_dir``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = config or TinyConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = texts if texts is not None else training_texts(config.world_seed)
    tokenizer = build_tokenizer(texts, config.vocab_size)
    check_name_tokens(tokenizer)
    tokenizer.save_pretrained(out)
    _mark_qwen2(out)
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(config.seed)
    model = Qwen2ForCausalLM(model_config)
    if config.pretrain_steps:
        from mempo_sim.pretrain import drill_accuracy, drill_texts, pretrain, probe_drills

        log.info("pretraining the tiny model: %d steps of reading drills", config.pretrain_steps)
        probe = probe_drills(config.world_seed, count=50)
        pretrain(model, tokenizer, drill_texts(config.pretrain_worlds, seed=config.seed), config.pretrain_steps,
                 log_every=100, probe=lambda: drill_accuracy(model, tokenizer, probe))
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
    )
    model.save_pretrained(out, safe_serialization=True)
    make_world_readable(out)
    (out / "tiny_config.json").write_text(json.dumps(asdict(config), indent=2))
    log.info("built tiny model (%d params) in %s", sum(p.numel() for p in model.parameters()), out)
    return out


def _mark_qwen2(out: Path) -> None:
    """Name the tokenizer class as Qwen2's so SGLang and AutoTokenizer load it the same way."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    path.write_text(json.dumps(cfg, indent=2))


def make_world_readable(directory: Path) -> None:
    """safetensors files are written 0600; engines in other containers must read them."""
    for path in [directory, *directory.rglob("*")]:
        mode = 0o755 if path.is_dir() else 0o644
        try:
            os.chmod(path, mode)
        except OSError as exc:  # pragma: no cover - foreign-owned files
            log.warning("cannot chmod %s: %s", path, exc)


ASSETS = Path(__file__).parent / "assets"  # shipped builds, tiny-<key> as in the cache


def shipped(config: TinyConfig) -> Path:
    """Where the build of ``config`` is shipped with the package (it may not be)."""
    return ASSETS / f"tiny-{config.key()}"


def ensure_tiny(cache_dir: str | Path, config: TinyConfig | None = None) -> Path:
    """The tiny model for ``config``: the shipped build when there is one for this exact
    recipe (the pretrained ``reader`` takes minutes to build), else built once under
    ``cache_dir`` (atomic rename)."""
    config = config or TinyConfig()
    texts = training_texts(config.world_seed)
    name = f"tiny-{config.key(texts)}"
    for found in (ASSETS / name, Path(cache_dir) / name):
        if (found / "model.safetensors").exists():
            return found
    final = Path(cache_dir) / name
    if config.pretrain_steps:
        log.warning("no shipped build of this pretrained tiny model: building it (minutes) in %s", final)
    with atomic_dir(final, prefix=".tiny-", replace=False) as tmp:  # a race: the first one kept
        build_tiny(tmp, config, texts)
    return final


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEMPO_CACHE", Path.home() / ".cache" / "mempo"))
