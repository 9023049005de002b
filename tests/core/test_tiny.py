"""The tiny model: ids survive a reload, tags are single tokens, deterministic build."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mempo.agent_format import DEFAULT_TAGS
from mempo.tiny import TinyConfig, training_texts


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

    from mempo.tiny import build_tiny

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

    code = "from mempo.tiny import PRESETS; print(PRESETS['test'].key())"
    keys = {
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                       capture_output=True, text=True, check=True).stdout.strip()
        for seed in ("1", "2", "3")
    }  # fmt: skip
    assert len(keys) == 1 and keys == {TinyConfig().key()}


def test_held_out_names_are_spelled_with_trained_tokens(tokenizer: Any, world: Any) -> None:
    """No name is one token, and every token of a test-split subject or answer is also
    written on train-split tasks (subjects in queries, answers, the memory's Q labels):
    the policy can write a held-out entity's name with tokens it was trained to write."""
    from mempo.lexicon import name_syllables

    def tokens(texts: set[str]) -> set[int]:
        return {
            i for t in texts for lead in ("", " ") for i in tokenizer.encode(lead + t, add_special_tokens=False)
        }

    def written(split: str) -> set[str]:
        questions = world.split_questions(split)
        return {q.subject for q in questions} | {a for q in questions for a in q.answers}

    for name in world.kinds:
        for word in name.split():
            if name_syllables(word):
                assert len(tokenizer.encode(word, add_special_tokens=False)) >= 2, word
    assert len(written("test") - written("train")) >= 20
    assert tokens(written("test")) <= tokens(written("train") | {"Q1 Q2"})


def test_name_syllables() -> None:
    from mempo.lexicon import name_syllables

    assert name_syllables("Holbar") == ["Hol", "bar"]
    assert name_syllables("Nimulgraia") == ["Nim", "ul", "gra", "ia"]
    assert name_syllables("Society") is None and name_syllables("") is None


def test_vocabulary_covers_the_learner_tests_random_ids(tokenizer: Any) -> None:
    from tests.services.learner.service_support import VOCAB

    assert len(tokenizer) > VOCAB
