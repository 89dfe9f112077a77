"""Inner learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak.

Indexed by the *global* inner step (all windows so far), so a restarted peer continues the schedule
where it stopped instead of warming up again.
"""

from __future__ import annotations

import math

from protocol.config import InnerConfig

__all__ = ["lr_at"]


def lr_at(step: int, cfg: InnerConfig) -> float:
    """Learning rate for global inner step ``step`` (0-based).

    Warm-up: ``lr·(step+1)/warmup_steps`` for ``step < warmup_steps``; then cosine from ``lr`` to
    ``lr·min_lr_ratio`` at ``total_steps``; constant ``lr·min_lr_ratio`` afterwards.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))
