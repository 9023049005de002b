"""Reading-drill pretraining of the tiny model, on worlds the agent never sees.

A randomly initialised network cannot copy: it has no induction heads (attend to where
the current pattern occurred before, predict what followed it), and an agent needs them
to carry a name from a search result into its memory and its answer. Real policies start
from pretrained LMs; this gives the tiny one a start of that kind, on worlds other than
the agent's (seeds from ``FIRST_WORLD``). A drill is in the agent's order (``Question:
q``, the top-3 search result for its subject, ``Answer: a``), or a search result for a
random entity followed by every 1-hop question about its passages with their answers. Every name is one
token (mempo_sim/lexicon.py), so answering a drill is one copy. The loss is the language
model's on all of it, with each answer weighted 10 times (``answer_weights``): unweighted,
the tiny model learns to copy names in ~300 steps but not which name a question asks
for. The answer accuracy on drills of the agent's own world (``drill_accuracy``) is
measured in docs/results.md.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from mempo.schedule import cosine_schedule

log = logging.getLogger(__name__)

ANSWER_WEIGHT = 10.0  # loss weight of a drill's answer token against any other token
FIRST_WORLD = 1000  # pretraining worlds: seeds FIRST_WORLD, +1, ... (never the default 0)


def drill_texts(worlds: int, drills_per_world: int = 400, seed: int = 0) -> list[str]:
    """Reading drills of ``worlds`` worlds (seeds ``FIRST_WORLD``, +1, ...), shuffled."""
    from mempo.bm25 import LocalSearch
    from mempo_sim.world import World, WorldConfig

    rng = random.Random(seed)
    texts: list[str] = []
    for index in range(worlds):
        world = World.generate(WorldConfig(seed=FIRST_WORLD + index))
        texts.extend(world_drills(world, LocalSearch(world.passages), drills_per_world, rng))
    rng.shuffle(texts)
    return texts


def world_drills(world: Any, search: Any, count: int, rng: random.Random) -> list[str]:
    """``count`` drills of one world. Half are in the agent's order: a 1-hop question, the
    search result for its subject (what the agent's first search returns), the answer.
    Half list every 1-hop question about the passages of a search result for a random
    entity after it, each with its answer."""
    from mempo.agent_format import format_documents

    one_hop: dict[str, list[Any]] = {}
    for q in world.questions:
        if q.hops == 1:
            one_hop.setdefault(q.subject, []).append(q)
    asked = [q for qs in one_hop.values() for q in qs]
    questions = [rng.choice(asked) if rng.random() < 0.5 else None for _ in range(count)]
    queries = [q.subject if q else rng.choice(list(world.kinds)) for q in questions]
    drills = []
    for q, docs in zip(questions, search.retrieve(queries, 3), strict=True):
        information = format_documents(docs)
        if q is not None:
            drills.append(f"Question: {q.text}\n{information}\nAnswer: {q.answers[0]}")
            continue
        titles = [d.get("document", d)["contents"].split("\n", 1)[0] for d in docs]
        listed = [q for title in titles for q in one_hop.get(title, [])]
        rng.shuffle(listed)
        drills.append(information + "\n" + "".join(f"Question: {q.text}\nAnswer: {q.answers[0]}\n" for q in listed))
    return drills


def probe_drills(world_seed: int = 0, count: int = 100, seed: int = 0) -> list[str]:
    """``count`` drills in the agent's order from world ``world_seed`` (the agent's own
    world by default: pretraining never sees it), for ``drill_accuracy``."""
    from mempo.bm25 import LocalSearch
    from mempo_sim.world import World, WorldConfig

    world = World.generate(WorldConfig(seed=world_seed))
    search, rng = LocalSearch(world.passages), random.Random(seed)
    drills: list[str] = []
    while len(drills) < count:
        drills.extend(d for d in world_drills(world, search, count, rng) if d.startswith("Question"))
    return drills[:count]


def drill_accuracy(model: Any, tokenizer: Any, drills: list[str]) -> float:
    """How often the model's most likely next token after ``Answer:`` is the answer
    (greedy, one token), over ``drills`` (``probe_drills``)."""
    import torch

    hits = 0
    model.eval()
    with torch.no_grad():
        for drill in drills:
            prompt, answer = drill.rsplit(" ", 1)
            ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])  # (1, T)
            target = tokenizer.encode(" " + answer, add_special_tokens=False)
            hits += int(model(input_ids=ids).logits[0, -1].argmax()) == target[0]
    return hits / len(drills)


def pack_rows(texts: list[list[int]], eos: int, length: int) -> list[list[int]]:
    """Token lists (each + EOS) packed greedily, in order, into rows of at most ``length``
    tokens; a text is never split, and one longer than a row is left out."""
    rows: list[list[int]] = [[]]
    for ids in texts:
        ids = [*ids, eos]
        if len(ids) > length:
            continue
        if len(rows[-1]) + len(ids) > length:
            rows.append([])
        rows[-1].extend(ids)
    return [row for row in rows if row]


def answer_weights(ids: Any, answer: int, colon: int, weight: float) -> Any:
    """(N, L) loss weights: ``weight`` on each token right after ``Answer`` ``:``, 1 elsewhere.

    Answers are 2-4 of a drill's ~110 tokens; with equal weights their loss is drowned by
    the passages' unpredictable facts, and the tiny model learns to copy some name, not
    the one the question asks for (drill accuracy 0.10 after 600 steps, measured)."""
    import torch

    out = torch.ones(ids.shape, dtype=torch.float32)  # (N, L)
    after = (ids[:, :-2] == answer) & (ids[:, 1:-1] == colon)  # (N, L - 2): the token at +2 answers
    out[:, 2:] += (weight - 1.0) * after.float()
    return out


def pretrain(
    model: Any,
    tokenizer: Any,
    texts: list[str],
    steps: int,
    lr: float = 3e-3,
    batch_size: int = 16,
    length: int = 256,
    answer_weight: float = ANSWER_WEIGHT,
    log_every: int = 50,
    probe: Callable[[], float] | None = None,
) -> list[float]:
    """Next-token prediction on ``texts``, each followed by EOS and never cut: whole texts
    are packed into ``length``-token rows, the rest of a row padded (no loss there), so a
    drill's question and its answer always lie in the same row. The answer after each
    ``Answer:`` weighs ``answer_weight`` times a token of the rest (``answer_weights``).
    AdamW with warmup and cosine decay; rows are cycled. Returns the losses (weighted
    means); ``probe`` (a drill accuracy) is logged with them."""
    import torch

    rows = pack_rows([tokenizer.encode(t, add_special_tokens=False) for t in texts], tokenizer.eos_token_id, length)
    if not rows:
        raise ValueError(f"no pretraining text fits in {length} tokens")
    ids = torch.tensor([row + [tokenizer.pad_token_id] * (length - len(row)) for row in rows])  # (N, L)
    real = torch.tensor([[1.0] * len(row) + [0.0] * (length - len(row)) for row in rows])  # (N, L)
    answer, colon = tokenizer.convert_tokens_to_ids(["Answer", ":"])
    if tokenizer.encode("\nAnswer: x", add_special_tokens=False)[1:3] != [answer, colon]:
        raise ValueError("the tokenizer does not write 'Answer:' as the two tokens 'Answer' ':'")
    weights = (real * answer_weights(ids, answer, colon, answer_weight))[:, 1:]  # (N, L - 1): of each target
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(20, steps, 0.1))
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(steps):
        picked = torch.arange(step * batch_size, (step + 1) * batch_size) % len(ids)  # (B,)
        logits = model(input_ids=ids[picked]).logits[:, :-1]  # (B, L - 1, V)
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[picked, 1:], reduction="none")  # (B, L - 1)
        loss = (nll * weights[picked]).sum() / weights[picked].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            rate = (step + 1) * batch_size * length / (time.perf_counter() - started)
            accuracy = f" drill accuracy {probe():.2f}" if probe is not None else ""
            model.train()
            log.info("pretrain step %d/%d loss %.4f tokens/s %.0f%s", step + 1, steps, losses[-1], rate, accuracy)
    model.eval()
    return losses
