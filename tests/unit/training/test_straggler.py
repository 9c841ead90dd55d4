"""Straggler detection from per-rank compute times, and the ``slow`` fault's parsing."""

from __future__ import annotations

import pytest

from meshtrain import faults
from meshtrain.training.straggler import StragglerDetector


def test_slowest_rank_and_its_excess_over_the_others_median():
    detector = StragglerDetector(1.5, 3, verbose=False)
    record = detector.observe(1, [0.10, 0.11, 0.30, 0.09])
    assert record["rank"] == 2
    assert record["excess_s"] == pytest.approx(0.30 - 0.10)
    assert record["factor"] == pytest.approx(3.0)
    assert detector.observe(1, [0.1]) is None  # one rank: nobody waits


def test_warning_after_k_slow_steps_in_a_row_only():
    detector = StragglerDetector(1.5, 3, verbose=False)
    slow, even = [0.1, 0.1, 0.1, 0.2], [0.1, 0.1, 0.1, 0.1]
    for step, times in enumerate([slow, slow, even, slow, slow], start=1):
        detector.observe(step, times)
    assert detector.warnings == []  # the streak was broken at step 3
    detector.observe(6, slow)
    detector.observe(7, slow)  # still slow: warned once per streak
    assert len(detector.warnings) == 1
    assert detector.warnings[0].startswith("meshtrain: warning: step 6: rank 3 is a straggler")
    assert "2.0 x the other ranks' median 0.100 s" in detector.warnings[0]


def test_two_ranks_compare_with_each_other():
    detector = StragglerDetector(1.5, 1, verbose=False)
    assert detector.observe(1, [0.3, 0.1])["rank"] == 0
    assert "rank 0 is a straggler" in detector.warnings[0]
    off = StragglerDetector(0, 1, verbose=False)
    assert off.observe(1, [0.3, 0.1])["rank"] == 0 and off.warnings == []


def test_slow_fault_parses_and_applies_from_its_step(monkeypatch):
    assert faults.parse("slow:rank=3:factor=3") == (faults.Fault("slow", 1, rank=3, factor=3.0),)
    with pytest.raises(ValueError, match="needs rank=N and factor=X"):
        faults.parse("slow:factor=3")
    monkeypatch.setenv(faults.ENV_VAR, "slow:rank=1:factor=2.5:step=4")
    monkeypatch.setenv("RANK", "1")
    faults.reset()
    try:
        assert [faults.slow_factor(step) for step in (3, 4, 9)] == [1.0, 2.5, 2.5]
        monkeypatch.setenv("RANK", "0")
        assert faults.slow_factor(5) == 1.0
    finally:
        faults.reset()
