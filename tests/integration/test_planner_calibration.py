"""TIMING TEST, generous bounds: after calibrating this machine, the planner's predicted step
times of a small model (one process, dp2, tp2, pp2 1F1B) are within 2x of measured.

The target on a quiet machine is 15 % (see the table in docs/planner.md, made with
``python -m meshtrain.commands.cpu_check``). This test runs on a shared 2-core machine where other
jobs change the CPU share a process gets by several times within a minute, so it only checks
that the model is not grossly wrong: a prediction outside [measured / 2, 2 x measured] is
re-measured once (a fresh calibration and run) before failing. ``MESHTRAIN_SKIP_TIMING=1`` skips
it.
"""

from __future__ import annotations

import os

import pytest

from meshtrain.commands.cpu_check import LAYOUTS, format_table, measure, predict, small_config
from meshtrain.planner.calibrate.measure import calibrate

pytestmark = pytest.mark.skipif(os.environ.get("MESHTRAIN_SKIP_TIMING") == "1",
                                reason="MESHTRAIN_SKIP_TIMING=1: timing tests skipped")

BOUND = 2.0
SHAPE = {"dim": 128, "layers": 4, "seq": 128, "batch": 8}
"""Small enough that the four layouts run in seconds; large enough that GEMMs dominate."""


def _profile():
    return calibrate(2, sizes=[2**12, 2**16, 2**20, 2**22], matmul_sizes=[256, 512], repeats=2)


def _row(name: str, profile, run_dir) -> dict:
    extra, world = LAYOUTS[name]
    config = small_config(extra, world, run_dir=str(run_dir), **SHAPE)
    predicted = predict(config, world, profile)["step_time_s"]
    times = sorted(measure(config, world, steps=3))
    measured = times[len(times) // 2]
    return {"layout": name, "predicted_s": predicted, "measured_s": measured,
            "error": predicted / measured - 1}


@pytest.mark.slow  # a measurement: `make bench`
def test_timing_predictions_within_2x_of_measured(tmp_path):
    profile = _profile()
    # Two local processes share memory: the data-parallel reduction they use is measured too.
    assert profile.shared_memory_reduce_gbps > 0
    assert len(profile.measured["shared_memory_all_reduce"]) == 4
    rows = [_row(name, profile, tmp_path) for name in LAYOUTS]
    print(format_table(rows))  # shown with -s / on failure
    outside = [r for r in rows if not 1 / BOUND <= 1 + r["error"] <= BOUND]
    if outside:  # one re-measurement: the machine is shared
        profile = _profile()
        retried = {r["layout"]: _row(r["layout"], profile, tmp_path) for r in outside}
        print("re-measured:\n" + format_table(list(retried.values())))
        outside = [r for r in retried.values() if not 1 / BOUND <= 1 + r["error"] <= BOUND]
    assert not outside, format_table(outside)
