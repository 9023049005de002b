"""The demo's held-out check: does RL make the policy better on questions it never saw?

Every distinct held-out 1-question task of the agent's world, once each, greedy, through
the same services as ``mempo eval`` (retrieval, a CPU engine, a rollout worker). The
demo runs it on the warm-started policy (cached next to it, so only the first run pays)
and on the last published weights, and reports both as ``heldout_em_start`` and
``heldout_em_end``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from mempo_cli.launcher.evaluate import EvalOptions, evaluate

HELDOUT = EvalOptions(ks=(1,), modes=("memory",), every_question=True)
CACHE_FILE = "heldout.json"


@dataclass(frozen=True)
class HeldOut:
    em: float
    questions: int
    format_rate: float


def heldout_key(opts: EvalOptions = HELDOUT) -> str:
    spec = json.dumps(asdict(opts), sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def heldout_score(policy: Path, out: Path, opts: EvalOptions = HELDOUT) -> HeldOut:
    """Evaluate ``policy`` on the held-out set (logs and eval.json under ``out``)."""
    report = evaluate(policy, out, opts)
    figures = report["results"]["memory"]["1"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(report, indent=1))
    return HeldOut(em=figures["em"], questions=int(figures["tasks"]), format_rate=figures["format_rate"])


def cached_heldout_score(policy: Path, out: Path, opts: EvalOptions = HELDOUT) -> HeldOut:
    """``heldout_score`` of a policy whose folder is ours (the warm start's cache): read
    from ``policy/heldout.json`` when it was written for these options, else measured and
    written there (atomically)."""
    cache, key = policy / CACHE_FILE, heldout_key(opts)
    try:
        cached = json.loads(cache.read_text())
        if cached.pop("key") == key:
            return HeldOut(**cached)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing, torn or from other options: measure again
    score = heldout_score(policy, out, opts)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({**asdict(score), "key": key}))
    tmp.replace(cache)
    return score
