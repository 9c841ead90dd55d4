"""Learning-rate schedules: linear warm-up followed by cosine, constant, or warmup-stable-decay."""

from __future__ import annotations

import math

from meshtrain.config import TrainConfig


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """LR for optimizer step ``step`` (0-based) of ``cfg.steps``.

    - ``cosine``: warm-up to ``lr`` then cosine decay to ``min_lr`` at the last step.
    - ``constant``: warm-up to ``lr`` then flat.
    - ``wsd`` (warmup-stable-decay, Hu et al. 2024): warm-up, flat at ``lr``, then a linear decay
      to ``min_lr`` over the last ``decay_fraction`` of the steps.
    """
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    total = max(cfg.steps - 1, 1)
    if cfg.lr_schedule == "cosine":
        span = max(total - cfg.warmup_steps, 1)
        progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    if cfg.lr_schedule == "wsd":
        decay_steps = max(int(round(cfg.steps * cfg.decay_fraction)), 1)
        decay_start = cfg.steps - decay_steps
        if step < decay_start:
            return cfg.lr
        progress = min((step - decay_start + 1) / decay_steps, 1.0)
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    raise ValueError(f"unknown lr_schedule {cfg.lr_schedule!r}")
