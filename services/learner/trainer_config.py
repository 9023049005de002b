"""The PPO trainer's configuration (prime-rl style: pydantic, a docstring on every field).

Defaults follow docs/architecture.md, 'The algorithm' and verl's ``core_algos`` (clip 0.2,
dual clip 3.0, k3 KL with beta 0.001, token-mean aggregation), except the learning rate:
1e-4 suits the tiny local model; 7B-class models use 1e-6 (verl's GRPO recipes).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mempo.advantages import MEM_MIN_STD, MemBaseline, MemGate, MemNorm
from mempo.losses import AggMode, KLKind

Dtype = Literal["float32", "bfloat16", "float16"]


class TrainerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    # ----------------------------------------------------------------- optimizer
    lr: float = Field(default=1e-4, gt=0)
    """Peak AdamW learning rate. 1e-4 is for the tiny local model; 7B-class models use 1e-6."""

    warmup_steps: int = Field(default=10, ge=0)
    """Optimizer steps of linear warmup from lr / warmup_steps to lr."""

    decay_steps: int = Field(default=0, ge=0)
    """Train steps after which the learning rate has decayed along a cosine to
    ``lr * final_lr_ratio`` (counted from the start, warmup included; constant afterwards).
    0: constant after the warmup."""

    final_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Where the cosine ends, as a fraction of ``lr`` (with ``decay_steps`` > 0)."""

    weight_decay: float = Field(default=0.01, ge=0)
    """AdamW decoupled weight decay (verl's actor default)."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""

    adam_eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""

    grad_clip: float = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this before every optimizer step."""

    # ----------------------------------------------------------------- PPO loop
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each step's batch."""

    mini_batches: int = Field(default=2, ge=1)
    """Optimizer steps per epoch: the shuffled batch is split into this many mini-batches."""

    micro_batch_tokens: int = Field(default=8192, ge=16)
    """Token budget of one forward/backward (gradient accumulation inside a mini-batch).
    A sequence longer than this runs alone in its own micro-batch."""

    row_tokens: int | None = Field(default=512, ge=16)
    """Longest packed row inside a micro-batch. Attention with a dense block-diagonal mask
    (sdpa, eager) costs row length squared, so several short rows are cheaper (the tiny
    model's SFT on CPU: 22k tokens/s at 512, 12k at 2048); a longer sequence gets a row
    of its own. With flash-attention's varlen kernels set None: one row per micro-batch."""

    packing: bool = True
    """Pack sequences without padding (position ids restart per sequence). False pads each
    sequence to the longest of its micro-batch: the reference layout of the parity test."""

    # ----------------------------------------------------------------- loss
    clip_low: float = Field(default=0.2, ge=0)
    """PPO ratio clip below 1 (1 - clip_low)."""

    clip_high: float = Field(default=0.2, ge=0)
    """PPO ratio clip above 1 (1 + clip_high)."""

    clip_c: float = Field(default=3.0, gt=1.0)
    """Dual clip: the loss of a negative-advantage token is bounded by -A * clip_c."""

    beta_kl: float = Field(default=0.001, ge=0)
    """Weight of the KL(pi || pi_ref) penalty; 0 skips the reference model entirely."""

    kl_kind: KLKind = "k3"
    """KL estimator: k3 (low-variance, default), k1, k2, abs."""

    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus weight (the entropy is always reported as a metric)."""

    loss_agg: AggMode = "token-mean"
    """token-mean, seq-mean-token-mean, seq-mean-token-sum, or traj-mean-token-mean (the
    paper's Eq. 10); see mempo.losses.agg_loss."""

    mem_loss: Literal["shared", "span-mean"] = "shared"
    """How the <mem> tokens' loss is aggregated. shared: like every other token (loss_agg).
    span-mean (FoldAct's separated loss, arXiv 2512.22733; loss_agg token-mean only): the
    token-mean over the tokens outside <mem> plus the mean over <mem> spans of each span's
    own token-mean, so a short summary is not diluted by the whole response."""

    # ----------------------------------------------------------------- advantages
    alpha: float = Field(default=1.0, ge=0)
    """Weight of MemPO's memory advantage on <mem> tokens; 0 gives plain GRPO."""

    mem_min_std: float = Field(default=MEM_MIN_STD, ge=0)
    """A memory-advantage pool whose P_mem - P_full std is below this gets no memory
    advantage (0: only a zero-variance pool gets none). Keeps the noise of a policy that
    rarely knows the answer from becoming unit-scale advantages; see
    mempo.advantages.MEM_MIN_STD and docs/results.md."""

    mem_baseline: MemBaseline = "full"
    """What a memory is measured against, R_M = P_mem - baseline. full: P_full, the full
    history it replaces (MemPO). none: P_task, the task alone with an empty memory
    (InfoMem, arXiv 2606.03329). prev: the previous round's P_mem (HiMPO, arXiv
    2606.16285; round 0 against P_task). none and prev have the scorer compute P_task
    (one more context per task)."""

    mem_gate: MemGate = "all"
    """all: every trajectory's memories get A_M. success: A_M times 1[R_T > 0] after
    normalisation, so only memories of trajectories that succeeded earn credit (InfoMem)."""

    mem_norm: MemNorm = "pool"
    """How R_M becomes A_M. pool: z-score over every (trajectory, round) of a group
    (MemPO). round: z-score per round index within the group. centred: R_M minus its
    pool's mean, not divided by the spread (Dr.GRPO's choice applied to the memory term:
    memories that barely differ get little credit instead of unit spread). mem_min_std
    silences a pool (or round) whose std is below it in every case."""

    neg_adv_scale: float = Field(default=1.0, gt=0, le=1)
    """Multiplies every negative per-token advantage (after A_T + alpha * A_M); positive
    and zero ones are unchanged. 1 is the definition (docs/architecture.md, 'The
    algorithm'). A tiny policy that succeeds on 10-20% of rollouts gives most of them a
    negative advantage, and pushing down tokens sampled at T=1 spreads mass onto garbage
    until the policy drifts; 0.2 kept it stable (issue 23, docs/results.md). See
    mempo.advantages.scale_negative."""

    norm_by_std: bool = True
    """Divide the outcome advantage by the group's std (False: Dr.GRPO, centred reward only)."""

    eps: float = Field(default=1e-6, gt=0)
    """Added to the std in both advantage normalisations."""

    recompute_old_logprobs: bool = True
    """Recompute the behaviour log-probs with the trainer's weights (True), or use the
    rollout engine's; the rollout/trainer gap is reported either way. With one update per
    step (ppo_epochs = mini_batches = 1) the update's own forward serves (no extra pass)."""

    # ----------------------------------------------------------------- runtime
    seed: int = 0
    """Seeds torch/numpy/python and the mini-batch shuffling (which also mixes in the step)."""

    dtype: Dtype = "float32"
    """Compute dtype. Master weights and optimizer state stay float32; bfloat16 / float16
    run the forward and backward in that dtype (autocast, or FSDP2 mixed precision)."""

    export_dtype: Dtype | None = None
    """dtype of published HF weights; None keeps float32."""

    attn_implementation: str = "sdpa"
    """transformers attention: sdpa, eager, flash_attention_2 (varlen packing on GPU)."""

    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, about 30% more compute)."""

    keep_last: int = Field(default=3, ge=1)
    """Checkpoints kept on disk; older ones are deleted once a new one is durable."""

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.row_tokens is not None and self.row_tokens > self.micro_batch_tokens:
            raise ValueError(
                f"row_tokens ({self.row_tokens}) exceeds micro_batch_tokens ({self.micro_batch_tokens})"
            )
        if self.mem_loss == "span-mean" and self.loss_agg != "token-mean":
            raise ValueError(
                f"mem_loss span-mean needs loss_agg token-mean (got {self.loss_agg!r})"
            )
        if self.clip_low >= 1.0:
            raise ValueError(f"clip_low must be below 1 (got {self.clip_low})")
        return self
