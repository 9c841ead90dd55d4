"""Learning-rate schedules."""

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
