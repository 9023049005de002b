"""``mempo eval``: a policy on held-out tasks with 1..10 questions, memory and full mode.

It starts the retrieval service, a CPU engine on the policy (or uses a running engine,
SGLang on a GPU, given its URL) and a rollout worker in HTTP-only mode (plus the scorer
when P_mem is wanted), sends every task to the worker's
``POST /v1/episodes`` (greedy decoding, one episode per task), and reports per number of
questions and mode: EM, F1, format rate, total and peak tokens per task.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from mempo.agent_format import first_prompt_ids, full_next_prompt_ids, information_ids
from mempo.procs import free_port
from mempo.rewards import multi_f1
from mempo.schemas import Group, Task
from mempo.tracking import Tracker
from mempo_cli.launcher.supervisor import Supervisor
from mempo_cli.launcher.transcripts import count_failures, write_transcripts
from mempo_cli.launcher.up import ONE_THREAD, local_url
from mempo_sim.world import World, WorldConfig
from services.retrieval.settings import RetrievalSettings
from services.rollout.engine.settings import EngineSettings
from services.rollout.settings import WorkerSettings
from services.scorer.settings import ScorerSettings

log = logging.getLogger(__name__)


@dataclass
class EvalOptions:
    ks: Sequence[int] = (1, 2, 4, 6, 8, 10)
    tasks: int = 20
    modes: Sequence[str] = ("memory", "full")
    split: str = "test"
    world_seed: int = 0
    task_seed: int = 1000  # distinct from training's task seeds
    score: bool = False  # also report P_mem / P_full (starts the scorer)
    concurrency: int = 8
    max_new_tokens: int = 256
    engine_url: str | None = None  # a running engine serving the policy (no trailing /); None: start a CPU one
    every_question: bool = False  # k = 1: every distinct question of the split once (``tasks`` unused)
    transcripts: int = 0  # decoded episodes written per mode and k (mempo_cli.launcher.transcripts)
    track: Sequence[str] = ("jsonl",)  # trackers of the figures (mempo.tracking)


def summarize(groups: list[Group]) -> dict[str, float]:
    """EM, F1, format rate, tokens per task, peak tokens and (if scored) P_mem of n=1 groups."""
    trajs = [g.trajectories[0] for g in groups]
    f1 = [
        statistics.fmean(multi_f1(t.answer_text, g.task.answers)) if t.answer_text else 0.0
        for g, t in zip(groups, trajs, strict=True)
    ]
    peaks = [max(len(r.prompt_ids) + len(r.response_ids) for r in t.rounds) for t in trajs]
    p_mem = [p for t in trajs for p in t.p_mem]
    out = {
        "em": statistics.fmean(float(t.correct) for t in trajs),
        "f1": statistics.fmean(f1),
        "format_rate": statistics.fmean(float(t.format_ok) for t in trajs),
        "tokens_per_task": statistics.fmean(t.num_tokens for t in trajs),
        "peak_tokens": float(max(peaks)),
        "peak_tokens_mean": statistics.fmean(peaks),
        "rounds": statistics.fmean(len(t.rounds) for t in trajs),
        "tasks": float(len(groups)),
    }
    if p_mem:
        out["p_mem"] = statistics.fmean(p_mem)
        out["p_full"] = statistics.fmean(p for t in trajs for p in t.p_full)
    return out


def full_history_figures(tok: Any, groups: list[Group]) -> dict[str, float]:
    """What memory-mode episodes would have cost with the full history in context: each
    round's prompt replayed as full mode builds it (the first prompt, then every earlier
    response and search result appended), the same responses. Tokens per task and peak
    context, like ``summarize``'s, of the same episodes; a policy that never learnt full
    mode is measured by these, not by running it in full mode."""
    totals, peaks = [], []
    for group in groups:
        prompt, total, peak = first_prompt_ids(tok, group.task.questions), 0, 0
        for rnd in group.trajectories[0].rounds:
            response = rnd.response_ids.tolist()
            total, peak = total + len(prompt) + len(response), max(peak, len(prompt) + len(response))
            prompt = full_next_prompt_ids(prompt, response, information_ids(tok, rnd.information or ""))
        totals.append(total)
        peaks.append(peak)
    return {
        "full_history_tokens_per_task": statistics.fmean(totals),
        "full_history_peak_tokens": float(max(peaks)),
        "full_history_peak_tokens_mean": statistics.fmean(peaks),
    }


async def run_tasks(worker_url: str, tasks: list[Task], concurrency: int, score: bool) -> list[Group]:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0)) as http:

        async def one(task: Task) -> Group:
            async with limit:
                body = {"task": json.loads(task.model_dump_json()), "score": score}
                response = await http.post(f"{worker_url}/v1/episodes", json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"/v1/episodes: HTTP {response.status_code}: {response.text[:300]}")
                return Group.model_validate_json(response.text)

        return list(await asyncio.gather(*(one(t) for t in tasks)))


def eval_tasks(opts: EvalOptions, k: int, mode: str) -> list[Task]:
    world = World.generate(WorldConfig(seed=opts.world_seed))
    if opts.every_question:
        if k != 1:
            raise ValueError(f"every_question evaluates 1-question tasks only (got k = {k})")
        pairs = [([q.text], [list(q.answers)]) for q in world.split_questions(opts.split)]  # type: ignore[arg-type]
    else:
        pairs = world.tasks(opts.split, k, opts.tasks, seed=opts.task_seed + k)  # type: ignore[arg-type]
    return [Task(questions=q, answers=a, n=1, mode=mode, max_rounds=3 * k + 2) for q, a in pairs]  # type: ignore[arg-type]


def start_eval_services(sup: Supervisor, model: Path, opts: EvalOptions) -> str:
    """Retrieval, engine (unless ``opts.engine_url``), (scorer), worker in HTTP-only mode;
    returns the worker's URL."""
    retrieval = RetrievalSettings(port=free_port(), world_seed=opts.world_seed)
    first = [sup.start_service("retrieval", "retrieval serve", retrieval, ONE_THREAD)]
    engine_url = opts.engine_url
    if engine_url is None:
        engine = EngineSettings(port=free_port(), model_path=str(model), threads=1)
        first.append(sup.start_service("engine", "rollout engine", engine, ONE_THREAD))
        engine_url = local_url(engine.port)
    scorer_url = ""
    if opts.score:
        scorer = ScorerSettings(port=free_port(), model_path=str(model))
        first.append(sup.start_service("scorer", "scorer serve", scorer, ONE_THREAD))
        scorer_url = local_url(scorer.port)
    sup.wait_ready(first)
    worker = WorkerSettings(
        port=free_port(), redis_url="", consume=False, engine_url=engine_url, scorer_url=scorer_url,
        retrieval_url=local_url(retrieval.port), temperature=0.0, tokenizer_path=str(model),
        max_new_tokens=opts.max_new_tokens,
    )  # fmt: skip
    sup.wait_ready([sup.start_service("worker", "rollout worker", worker, ONE_THREAD)])
    return local_url(worker.port)


def check_engine(engine_url: str) -> None:
    """Fail now, with the reason, if the engine does not answer /model_info."""
    try:
        reply = httpx.get(f"{engine_url}/model_info", timeout=10.0)
        reply.raise_for_status()
        info = reply.json()
    except (httpx.HTTPError, ValueError) as exc:  # unreachable, an error status, not JSON
        raise RuntimeError(f"the engine at {engine_url} does not answer /model_info: {exc}") from None
    served = info.get("model_path") if isinstance(info, dict) else None
    log.info("evaluating on the engine at %s (serving %s)", engine_url, served)


def evaluate(model: Path, run_dir: Path, opts: EvalOptions) -> dict[str, Any]:
    """Evaluate ``model``; returns {"model", "results": {mode: {k: figures}}, "failures":
    {mode: {k: {kind: episodes}}}}, logs the figures to ``opts.track`` (``eval/<mode>/k<k>/
    <figure>``) and writes ``opts.transcripts`` decoded episodes per mode and k to
    ``run_dir`` (transcripts-<mode>-k<k>.md and .jsonl)."""
    from transformers import AutoTokenizer

    results: dict[str, dict[str, dict[str, float]]] = {mode: {} for mode in opts.modes}
    failures: dict[str, dict[str, dict[str, int]]] = {mode: {} for mode in opts.modes}
    if opts.engine_url:
        check_engine(opts.engine_url)
    tok = AutoTokenizer.from_pretrained(model)
    world = World.generate(WorldConfig(seed=opts.world_seed))
    with Supervisor(run_dir) as sup:
        worker = start_eval_services(sup, model, opts)
        for mode in opts.modes:
            for k in opts.ks:
                groups = asyncio.run(run_tasks(worker, eval_tasks(opts, k, mode), opts.concurrency, opts.score))
                results[mode][str(k)] = summarize(groups)
                if mode == "memory":
                    results[mode][str(k)] |= full_history_figures(tok, groups)
                failures[mode][str(k)] = count_failures(world, tok, groups)
                if opts.transcripts:
                    write_transcripts(run_dir / f"transcripts-{mode}-k{k}", world, tok,
                                      groups[: opts.transcripts], f"{model}: {mode} mode, k = {k}")  # fmt: skip
                log.info("eval %s k=%d: %s %s", mode, k, results[mode][str(k)], failures[mode][str(k)])
    _track(run_dir, model, opts, results)
    return {"model": str(model), "split": opts.split, "results": results, "failures": failures}


def _track(run_dir: Path, model: Path, opts: EvalOptions, results: dict[str, dict[str, dict[str, float]]]) -> None:
    """The figures to the trackers, as one step (0): ``eval/<mode>/k<k>/<figure>``."""
    from dataclasses import asdict

    tracker = Tracker(run_dir, opts.track, f"eval-{model.name}", asdict(opts), journal=True, resume=False)
    figures = {f"eval/{mode}/k{k}/{name}": value
               for mode, by_k in results.items() for k, named in by_k.items() for name, value in named.items()}  # fmt: skip
    tracker.log(figures, 0)
    tracker.close()


def plot_eval(report: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_em, ax_tok) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    for mode, by_k in report["results"].items():
        ks = sorted(by_k, key=int)
        ax_em.plot([int(k) for k in ks], [by_k[k]["em"] for k in ks], marker="o", label=f"{mode} EM")
        ax_tok.plot([int(k) for k in ks], [by_k[k]["tokens_per_task"] for k in ks], marker="o", label=f"{mode} total")
        ax_tok.plot([int(k) for k in ks], [by_k[k]["peak_tokens"] for k in ks], marker="x", linestyle="--",
                    label=f"{mode} peak")
    ax_em.set(title="Exact match", xlabel="questions per task", ylim=(-0.02, 1.02))
    ax_tok.set(title="Tokens per task", xlabel="questions per task", yscale="log")
    for ax in (ax_em, ax_tok):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
