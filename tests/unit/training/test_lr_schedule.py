"""Learning-rate schedules."""

import dataclasses
import math

import pytest

from meshtrain.config import TrainConfig
from meshtrain.training.lr_schedule import learning_rate


def test_warmup_then_cosine_to_min():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, lr_schedule="cosine")
    assert learning_rate(0, cfg) == pytest.approx(0.1)
    assert learning_rate(9, cfg) == pytest.approx(1.0)
    assert learning_rate(99, cfg) == pytest.approx(0.1)
    mid = 10 + (99 - 10) / 2
    assert learning_rate(int(mid), cfg) == pytest.approx(
        0.1 + 0.45 * (1 + math.cos(math.pi * (int(mid) - 10) / 89)))
    lrs = [learning_rate(s, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_constant_and_wsd():
    const = TrainConfig(steps=50, warmup_steps=0, lr=0.5, lr_schedule="constant")
    assert {learning_rate(s, const) for s in range(50)} == {0.5}
    wsd = TrainConfig(steps=100, warmup_steps=5, lr=1.0, min_lr=0.0, lr_schedule="wsd",
                      decay_fraction=0.2)
    assert learning_rate(50, wsd) == 1.0
    assert learning_rate(79, wsd) == 1.0
    assert learning_rate(99, wsd) == pytest.approx(0.0)
    assert 0 < learning_rate(90, wsd) < 1


def _resumed_lrs(cfg: TrainConfig, saved_total: int, start: int, steps: int):
    """The saved run's LR at its last step, and the longer resumed run's from ``start``."""
    from meshtrain.training.lr_schedule import continue_schedule

    saved = dataclasses.replace(cfg, steps=saved_total)
    longer = dataclasses.replace(cfg, steps=steps)
    anchor, note = continue_schedule(start, longer, saved_total, None)
    return (learning_rate(start - 1, saved), [learning_rate(s, longer, anchor)
                                              for s in range(start, steps)], note)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_longer_resume_continues_the_schedule(schedule):
    cfg = TrainConfig(warmup_steps=5, lr=3e-3, min_lr=3e-4, lr_schedule=schedule)
    last, after, note = _resumed_lrs(cfg, 20, 20, 40)  # a 20-step run resumed with 40
    assert after[0] == pytest.approx(last, rel=0.05)
    assert after[-1] == pytest.approx(cfg.min_lr if schedule != "constant" else cfg.lr)
    assert "20 -> 40" in note
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:], strict=False))


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_resume_mid_decay_redecays_from_the_current_rate(schedule):
    cfg = TrainConfig(warmup_steps=5, lr=1.0, min_lr=0.1, lr_schedule=schedule,
                      decay_fraction=0.5)
    _, after, _ = _resumed_lrs(cfg, 40, 30, 80)  # stopped at step 30 of 40, now 80
    # step 31 runs at the rate the 40-step run would have used there
    assert after[0] == pytest.approx(learning_rate(30, dataclasses.replace(cfg, steps=40)))
    assert after[0] < 1.0 and after[-1] == pytest.approx(0.1)


def test_resume_during_warmup_or_stable_keeps_the_longer_schedule():
    from meshtrain.training.lr_schedule import continue_schedule

    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, lr_schedule="cosine")
    assert continue_schedule(5, cfg, 50, None)[0] is None  # still warming up: no re-warm-up
    wsd = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, lr_schedule="wsd")
    assert continue_schedule(20, wsd, 50, None)[0] is None  # flat part: decay at the new end


def test_reset_and_old_checkpoints_recompute_over_the_new_total():
    from meshtrain.training.lr_schedule import continue_schedule

    cfg = TrainConfig(steps=40, warmup_steps=5, lr=1.0, min_lr=0.1, lr_schedule="cosine",
                      lr_schedule_reset=True)
    anchor, note = continue_schedule(20, cfg, 20, None)
    assert anchor is None and "lr_schedule_reset" in note
    anchor, note = continue_schedule(20, TrainConfig(steps=40), None, None)
    assert anchor is None and "does not record" in note


def test_same_total_keeps_the_saved_anchor():
    from meshtrain.training.lr_schedule import continue_schedule

    cfg = TrainConfig(steps=40, lr_schedule="cosine")
    assert continue_schedule(25, cfg, 40, [20, 0.5]) == ((20, 0.5), None)
