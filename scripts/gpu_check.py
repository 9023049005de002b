"""What only a GPU can check, in one run: one JSON report (``scripts/gpu-check``).

Parts, each timed and reported as ok / failed (with the error) / skipped (with why):

- ``scorer_bf16``: the scorer's prefix-shared forward in bf16 on CUDA against fp32 on the
  CPU, on memory-scoring rows of the tiny model: the largest difference of P (the
  answer's probability) and of per-token log-probs;
- ``learner_cuda``: PPO steps of the learner's Trainer on CUDA (fp32 master weights, the
  configured compute dtype): tokens/s and peak memory;
- ``fsdp2_one_gpu``: the learner's FSDP2 wrapping over a world of one: a bf16 forward
  and backward, its loss beside the plain model's under autocast;
- ``broadcast_nccl``: the weight broadcast (mempo/weight_sync.py) with NCCL between two
  processes, one GPU each: bytes/s and that every tensor arrived equal (needs 2 GPUs);
- ``engine_cuda``: not run: the CPU engine has no device option yet (its batch tensors
  are made on the CPU), so its code cannot run on CUDA as it is.

On a machine without CUDA every part is skipped and the exit status is 0. Needs torch
and transformers only (no sglang, no network); the tiny model is built locally.

    python scripts/gpu_check.py [--out report.json] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.services.learner.factories: real rollout groups

from mempo_sim.tiny import default_cache_dir, ensure_tiny  # noqa: E402


def part(fn: Callable[[], dict[str, Any]], needs_gpus: int = 1) -> dict[str, Any]:
    if torch.cuda.device_count() < needs_gpus:
        return {"status": "skipped", "why": f"needs {needs_gpus} CUDA device(s), found {torch.cuda.device_count()}"}
    started = time.perf_counter()
    try:
        result = {"status": "ok", **fn()}
    except Exception as exc:  # a report, not a crash: the other parts still run
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def scorer_bf16(model: Path) -> dict[str, Any]:
    from services.scorer.forward import shared_logprobs
    from services.scorer.model import load_model
    from services.scorer.plan import Row

    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(16):
        trunk = torch.randint(5, 500, (int(torch.randint(200, 900, (1,), generator=generator)),), generator=generator)
        row = Row(trunk=trunk.tolist())
        for attach in (len(row.trunk) // 2, len(row.trunk)):
            cue = row.add(torch.randint(5, 500, (8,), generator=generator).tolist(), attach)
            row.add(torch.randint(5, 500, (4,), generator=generator).tolist(), attach, parent=cue, scored=True)
        rows.append(row)
    cpu = shared_logprobs(load_model(model, "0", "cpu").model, rows)
    cuda = shared_logprobs(load_model(model, "0", "cuda").model, rows)
    token = max(abs(a - b) for k in cpu for a, b in zip(cpu[k], cuda[k], strict=True))
    prob = max(abs(torch.tensor(cpu[k]).sum().exp() - torch.tensor(cuda[k]).sum().exp()).item() for k in cpu)
    return {"rows": len(rows), "max_abs_logprob_diff": round(token, 5), "max_abs_p_diff": round(prob, 5)}


def learner_steps(model: Path, steps: int) -> dict[str, Any]:
    from services.learner.step import train_step
    from services.learner.trainer import Trainer
    from services.learner.trainer_config import TrainerConfig
    from tests.services.learner.factories import cached_groups

    groups = cached_groups(model, 4)
    trainer = Trainer(TrainerConfig(beta_kl=0.02), model, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    train_step(trainer, [g.model_copy(deep=True) for g in groups])  # warm-up
    torch.cuda.synchronize()
    started, rates, metrics = time.perf_counter(), [], {}
    for _ in range(steps):
        metrics = train_step(trainer, [g.model_copy(deep=True) for g in groups])
        rates.append(float(metrics["tokens_per_s"]))
    torch.cuda.synchronize()
    return {
        "steps": steps,
        "seconds_per_step": round((time.perf_counter() - started) / steps, 3),
        "tokens_per_s": round(sum(rates) / len(rates), 1),
        "peak_memory_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1),
        "loss": metrics.get("loss"),
    }


def fsdp2_one_gpu(model: Path) -> dict[str, Any]:
    """The learner's FSDP2 wrapping (services/learner/distributed.py: shard_model) over a
    world of one: a forward and backward agree with the plain model's."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from services.learner.distributed import DistContext, shard_model

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        ids = torch.randint(5, 500, (4, 256), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
        plain: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        plain.to("cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            expected = plain(input_ids=ids, labels=ids).loss.item()
        ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"))
        fresh: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        fresh.to("cuda")
        sharded: Any = shard_model(fresh, ctx, torch.bfloat16)
        loss = sharded(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = sum(1 for p in sharded.parameters() if p.grad is not None)
    finally:
        dist.destroy_process_group()
    return {"loss": round(loss.item(), 5), "plain_bf16_loss": round(expected, 5), "params_with_grad": grads}


def broadcast_nccl() -> dict[str, Any]:
    import subprocess

    port = _free_port()
    code = (
        "import sys, time, torch; from mempo.weight_sync import join_group, broadcast\n"
        "rank = int(sys.argv[1]); torch.cuda.set_device(rank)\n"
        f"group = join_group('127.0.0.1', {port}, rank, 2, backend='nccl', timeout_s=120)\n"
        "g = torch.Generator(device='cuda').manual_seed(0)\n"
        "x = torch.randn(64 * 2**20, device='cuda', generator=g) if rank == 0 else torch.empty(64 * 2**20, device='cuda')\n"
        "broadcast(group, x); torch.cuda.synchronize(); t = time.perf_counter()\n"
        "broadcast(group, x); torch.cuda.synchronize(); took = time.perf_counter() - t\n"
        "ref = torch.randn(64 * 2**20, device='cuda', generator=torch.Generator(device='cuda').manual_seed(0))\n"
        "print(took, bool(torch.equal(x, ref)))\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], cwd=REPO, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"exit codes {[p.returncode for p in procs]}")
    took = float(outs[1][0])
    return {"bytes": 256 * 2**20, "gb_per_s": round(256 * 2**20 / took / 1e9, 2), "equal": outs[1][1] == "True"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--steps", type=int, default=4, help="timed PPO steps")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
    }
    model = ensure_tiny(default_cache_dir()) if cuda else None
    report["scorer_bf16"] = part(lambda: scorer_bf16(model))  # type: ignore[arg-type]
    report["learner_cuda"] = part(lambda: learner_steps(model, args.steps))  # type: ignore[arg-type]
    report["fsdp2_one_gpu"] = part(lambda: fsdp2_one_gpu(model))  # type: ignore[arg-type]
    report["broadcast_nccl"] = part(broadcast_nccl, needs_gpus=2)
    report["engine_cuda"] = {"status": "skipped", "why": "the CPU engine has no device option yet"}
    failed = [name for name, value in report.items() if isinstance(value, dict) and value.get("status") == "failed"]
    report["failed"] = failed
    line = json.dumps(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    print(line)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
