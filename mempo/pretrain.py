"""Language-model pretraining of the tiny model on synthetic worlds' text.

A randomly initialised network cannot copy: it has no induction heads (attend to an
earlier occurrence of the current token, predict what followed it), and an agent needs
them to carry a name from a search result into its memory and its answer. Real policies
start from pretrained LMs; this gives the tiny one a start of the same kind: next-token
prediction on search results and questions of worlds other than the one the agent is
trained and evaluated on (seeds from 1000), where every passage repeats its entity's
name. 600 steps (about 5M tokens, 11 minutes on 2 cores) teach it to repeat a name
already repeated in a passage, not yet to copy one it has read once; docs/results.md
has the measurements.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

FIRST_WORLD = 1000  # pretraining worlds: seeds FIRST_WORLD, +1, ... (never the default 0)


def cosine_schedule(warmup_steps: int, steps: int, final_ratio: float) -> Callable[[int], float]:
    """LR multiplier at optimizer step ``step`` (0-based): linear warmup to 1, then a
    cosine down to ``final_ratio`` at the last step."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, steps - 1 - warmup_steps))
        return final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def pretraining_texts(worlds: int, results_per_world: int = 400, seed: int = 0) -> list[str]:
    """Search results (Search-R1's format, top-3 for an entity's name) and questions of
    ``worlds`` worlds, shuffled."""
    from mempo.agent_format import format_documents
    from mempo.bm25 import LocalSearch
    from mempo.world import World, WorldConfig

    rng = random.Random(seed)
    texts: list[str] = []
    for index in range(worlds):
        world = World.generate(WorldConfig(seed=FIRST_WORLD + index))
        search = LocalSearch(world.passages)
        names = list(world.kinds)
        texts.extend(q.text for q in world.questions)
        queries = [rng.choice(names) for _ in range(results_per_world)]
        texts.extend(format_documents(docs) for docs in search.retrieve(queries, 3))
    rng.shuffle(texts)
    return texts


def pretrain(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 16,
    length: int = 512,
    log_every: int = 50,
) -> list[float]:
    """Next-token prediction on ``texts`` (joined by EOS, cut into ``length``-token
    chunks, cycled); AdamW with warmup and cosine decay. Returns the losses."""
    import torch

    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer.encode(text, add_special_tokens=False))
        stream.append(tokenizer.eos_token_id)
    chunks = torch.tensor(stream[: len(stream) // length * length]).view(-1, length)  # (N, L)
    if len(chunks) == 0:
        raise ValueError(f"pretraining text holds fewer than {length} tokens")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(20, steps, 0.1))
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(steps):
        rows = torch.arange(step * batch_size, (step + 1) * batch_size) % len(chunks)
        batch = chunks[rows]  # (B, L)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            rate = (step + 1) * batch_size * length / (time.perf_counter() - started)
            log.info("pretrain step %d/%d loss %.4f tokens/s %.0f", step + 1, steps, losses[-1], rate)
    model.eval()
    return losses
