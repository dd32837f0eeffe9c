"""Learning-rate schedule: linear warmup, then cosine decay to lr·min_lr_ratio."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based); flat at the minimum past the horizon."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
