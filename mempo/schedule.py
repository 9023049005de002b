"""Learning-rate schedules, as LambdaLR multipliers (SFT, pretraining and RL share one)."""

from __future__ import annotations

import math
from collections.abc import Callable


def cosine_schedule(warmup_steps: int, steps: int, final_ratio: float) -> Callable[[int], float]:
    """LR multiplier at optimizer step ``step`` (0-based): linear warmup to 1, then a
    cosine down to ``final_ratio`` at step ``steps - 1``, constant after it (``final_ratio``
    1: constant after the warmup)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, steps - 1 - warmup_steps))
        return final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
