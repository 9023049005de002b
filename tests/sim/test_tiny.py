"""The tiny model: ids survive a reload, tags are single tokens, deterministic build."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mempo.agent_format import DEFAULT_TAGS
from mempo_sim.tiny import TinyConfig, training_texts


def test_ids_survive_reload(tiny_model_dir: Path, tokenizer: Any) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for text in [*training_texts()[:300], "héllo wörld 1854 — ünïcode\n\n<mem>x</mem>", "  two  spaces\t tab"]:
        assert tokenizer.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_tags_are_single_non_special_tokens(tokenizer: Any) -> None:
    for tag in DEFAULT_TAGS.all_tags():
        ids = tokenizer.encode(tag, add_special_tokens=False)
        assert len(ids) == 1, tag
        assert tokenizer.decode(ids, skip_special_tokens=True) == tag  # survives skip_special_tokens
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.decode(tokenizer.encode("<|im_end|>", add_special_tokens=False), skip_special_tokens=True) == ""


def test_model_loads_and_files_are_readable(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "qwen2"
    assert (tiny_model_dir / "model.safetensors").stat().st_mode & 0o044 == 0o044
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]))
    assert out.logits.shape == (1, 3, model.config.vocab_size)
    assert json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"


def test_build_is_deterministic(tmp_path: Path, tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    from mempo_sim.tiny import build_tiny

    again = build_tiny(tmp_path / "again", TinyConfig())
    assert (again / "tokenizer.json").read_text() == (tiny_model_dir / "tokenizer.json").read_text()
    a, b = load_file(again / "model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_cache_key_is_the_same_in_every_process() -> None:
    """String hashing is salted per process (PYTHONHASHSEED): a key that depended on a
    set's order would rebuild the model, and redo its SFT warm start, on every run."""
    import os
    import subprocess
    import sys

    code = "from mempo_sim.tiny import PRESETS; print(PRESETS['test'].key())"
    keys = {
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                       capture_output=True, text=True, check=True).stdout.strip()
        for seed in ("1", "2", "3")
    }  # fmt: skip
    assert len(keys) == 1 and keys == {TinyConfig().key()}


def test_every_pool_name_is_one_token_after_a_reload(tokenizer: Any) -> None:
    from mempo_sim.lexicon import NAMES

    for name in NAMES:
        assert len(tokenizer.encode(f" {name}", add_special_tokens=False)) == 1, name


def test_every_mention_of_a_name_is_the_same_token(tokenizer: Any, world: Any, local_search: Any) -> None:
    """Titles, passages, questions, memories, queries and answers, as the agent sees and
    writes them (chat-rendered prompt plus response): a name is always its one token."""
    import re

    from mempo.agent_format import first_prompt_ids, format_documents
    from mempo_sim.lexicon import NAMES
    from mempo_sim.oracle import Oracle

    token_of = {tokenizer.convert_tokens_to_ids(tokenizer.tokenize(f" {n}"))[0]: n for n in NAMES}
    mention = re.compile(r"\b(" + "|".join(NAMES) + r")\b")
    oracle = Oracle(world)
    for questions, _ in world.tasks("test", 2, 5, seed=1):
        texts = [tokenizer.decode(first_prompt_ids(tokenizer, questions))]
        for r in oracle.episode(questions, lambda q: format_documents(local_search.retrieve([q], 3)[0])):
            texts += [r.response, *([r.information] if r.information else [])]
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert [token_of[i] for i in ids if i in token_of] == mention.findall(text), text


def test_name_check_refuses_a_tokenizer_that_splits_names() -> None:
    import pytest

    from mempo_sim.tiny import build_tokenizer, check_name_tokens

    with pytest.raises(RuntimeError, match="not one token"):
        check_name_tokens(build_tokenizer(["no names here"], 300))


def test_vocabulary_covers_the_learner_tests_random_ids(tokenizer: Any) -> None:
    from tests.services.learner.service_support import VOCAB

    assert len(tokenizer) > VOCAB


def test_the_reader_is_shipped_for_the_current_recipe(tmp_path: Path) -> None:
    """The pretrained policy base takes minutes to build: every run must find it shipped.
    A change to the world, the oracle's texts or the recipe changes its key; then rebuild
    it with `mempo tiny build --preset reader --ship` and commit mempo_sim/assets/."""
    from mempo_sim.tiny import ASSETS, PRESETS, ensure_tiny, shipped

    reader = shipped(PRESETS["reader"])
    assert (reader / "model.safetensors").is_file(), "run: mempo tiny build --preset reader --ship"
    assert sorted(p.name for p in ASSETS.glob("tiny-*")) == [reader.name]  # no stale build
    assert json.loads((reader / "tiny_config.json").read_text())["pretrain_steps"] == PRESETS["reader"].pretrain_steps
    assert ensure_tiny(tmp_path, PRESETS["reader"]) == reader and not any(tmp_path.iterdir())
