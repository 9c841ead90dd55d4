"""Learning-rate schedules: linear warm-up followed by cosine, constant, or warmup-stable-decay.

A run resumed with a larger ``train.steps`` continues its schedule (:func:`continue_schedule`):
from the step it resumes at, the decay re-spans the remaining steps starting from the rate the
saved run had reached there (an *anchor*, ``(step, lr)``), with no second warm-up.
``train.lr_schedule_reset = true`` instead recomputes the whole schedule over the new total.
"""

from __future__ import annotations

import dataclasses
import math

from meshtrain.config import TrainConfig


def learning_rate(step: int, cfg: TrainConfig, anchor: tuple[int, float] | None = None) -> float:
    """LR for optimizer step ``step`` (0-based) of ``cfg.steps``.

    - ``cosine``: warm-up to ``lr`` then cosine decay to ``min_lr`` at the last step.
    - ``constant``: warm-up to ``lr`` then flat.
    - ``wsd`` (warmup-stable-decay, Hu et al. 2024): warm-up, flat at ``lr``, then a linear decay
      to ``min_lr`` over the last ``decay_fraction`` of the steps.

    ``anchor = (start, rate)``: a resumed run whose schedule was extended at step ``start``
    (:func:`continue_schedule`): from ``start`` on, the decay runs from ``rate`` (at ``start``)
    to ``min_lr`` at the last step, cosine-shaped for ``cosine``, linear for ``wsd``.
    """
    if anchor is not None and step >= anchor[0] and cfg.lr_schedule in ("cosine", "wsd"):
        start, rate = anchor
        progress = min((step - start) / max(cfg.steps - 1 - start, 1), 1.0)
        if cfg.lr_schedule == "cosine":
            return cfg.min_lr + 0.5 * (rate - cfg.min_lr) * (1 + math.cos(math.pi * progress))
        return rate + (cfg.min_lr - rate) * progress
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
        decay_start = _wsd_decay_start(cfg)
        if step < decay_start:
            return cfg.lr
        progress = min((step - decay_start + 1) / (cfg.steps - decay_start), 1.0)
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    raise ValueError(f"unknown lr_schedule {cfg.lr_schedule!r}")


def _wsd_decay_start(cfg: TrainConfig) -> int:
    """The first step of ``wsd``'s decay."""
    return cfg.steps - max(int(round(cfg.steps * cfg.decay_fraction)), 1)


def continue_schedule(start: int, cfg: TrainConfig, saved_total: int | None,
                      saved_anchor: tuple[int, float] | None
                      ) -> tuple[tuple[int, float] | None, str | None]:
    """The schedule of a run resumed at step ``start`` (0-based: the next step to run) whose
    checkpoint was saved by a run of ``saved_total`` steps with anchor ``saved_anchor``.

    Returns ``(anchor, note)``: the anchor to pass to :func:`learning_rate` for the rest of the
    run, and a line for the log when the schedule changed (else None). ``saved_total`` None (a
    checkpoint from before totals were saved) or ``cfg.lr_schedule_reset``: the schedule spans
    ``cfg.steps`` from step 0, as if the run had always been that long.
    """
    saved_anchor = tuple(saved_anchor) if saved_anchor else None
    if saved_total is None:
        note = (f"the checkpoint does not record its run's train.steps (saved before meshtrain "
                f"did); the learning-rate schedule spans train.steps = {cfg.steps} from step 1")
        return None, note
    if saved_total == cfg.steps:
        return saved_anchor, None
    if cfg.lr_schedule_reset:
        return None, (f"train.steps {saved_total} -> {cfg.steps} with train.lr_schedule_reset: "
                      f"the learning-rate schedule is recomputed over {cfg.steps} steps from "
                      f"step 1 (lr {learning_rate(start, cfg):.3g} at step {start + 1})")
    if cfg.steps < saved_total:  # a shorter run: the same decay, compressed to the new end
        return saved_anchor, None
    saved = dataclasses.replace(cfg, steps=saved_total)
    rate = learning_rate(start, saved, saved_anchor)
    if (saved_anchor is None and cfg.lr_schedule != "constant"
            and start >= cfg.warmup_steps
            and not (cfg.lr_schedule == "wsd" and start < _wsd_decay_start(saved)
                     and start < _wsd_decay_start(cfg))):
        anchor: tuple[int, float] | None = (start, rate)
    elif saved_anchor is not None:
        anchor = (start, rate)
    else:  # still warming up, constant, or wsd's flat part: the longer schedule is continuous
        anchor = None
    return anchor, (f"train.steps {saved_total} -> {cfg.steps}: the learning-rate schedule "
                    f"continues from {rate:.3g} at step {start + 1} over the remaining "
                    f"{cfg.steps - start} steps (train.lr_schedule_reset = true restarts it "
                    f"over {cfg.steps} steps)")
