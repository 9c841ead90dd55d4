"""TIMING TEST: the planner's exposed communication against meshtrain's measured step timeline.

Small two-process layouts (dp2 ZeRO-1 and ZeRO-2 with 4 micro-batches, dp2 ZeRO-3, tp2; a
dim-256 model on 32-token sequences, so communication is a large share of the step) train a few
steps on this CPU. From every step's metrics, the exposed part of communication is what the rank
spent inside blocking collectives and waiting for async ones (``wait_s``, counted by the comm
layer); the rest of the step is compute. The measured exposed fraction ``wait_s / step_time_s``
is compared with the estimate's (the ``overlap`` table's exposed seconds over all axes plus the
step's small syncs, over its step time) on a profile calibrated just before:

- tp2 (blocking collectives) and ZeRO-1 (one bucket here: it fires when backward ends, and is
  reduced once per step, during the last micro-batch): nothing can hide, the CPU profile's
  prediction must be within 0.2 of the measurement;
- ZeRO-2 and ZeRO-3 (asynchronous reduce-scatters behind every micro-batch's backward,
  prefetched gathers): the CPU profile prices them fully exposed (gloo's work takes the cores
  compute would use), an upper bound: the measurement must not exceed it by more than 0.2.
  It is below it: in five runs on 2026-12-02 ZeRO-3 measured 0.09-0.38 against 0.50-0.62
  priced (0.27-0.36 with the GPU model, ``comm_overlaps_compute = True``, printed beside) —
  gloo's worker thread progresses async collectives while compute runs, and much of a
  collective's calibrated per-call latency is a waiting process's wake-up, which the compute
  thread does not pay. The CPU profile does not model that.

Tolerance 0.2 absolute on the fraction: on this shared 2-core machine other jobs change the CPU
share a process gets by several times within a minute, and a rank that is descheduled makes its
peer wait (counted as exposed time). A row outside is re-measured once (fresh calibration).
``MESHTRAIN_SKIP_TIMING=1`` skips it.
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import pytest

from meshtrain.commands.cpu_check import predict, small_config
from meshtrain.planner.calibrate.measure import calibrate

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("MESHTRAIN_SKIP_TIMING") == "1",
                                 reason="MESHTRAIN_SKIP_TIMING=1: timing tests skipped")]

TOLERANCE = 0.2
LAYOUTS = {
    "dp2 zero1 m4": ["parallel.zero=1", "parallel.microbatches=4"],
    "dp2 zero2 m4": ["parallel.zero=2", "parallel.microbatches=4"],
    "dp2 zero3": ["parallel.zero=3"],
    "tp2": ["parallel.tp=2"],
}
SHAPE = {"dim": 256, "layers": 4, "seq": 32, "batch": 8}
ASYNC = ("dp2 zero2 m4", "dp2 zero3")
"""Layouts whose collectives the runtime issues asynchronously behind compute."""


def _profile():
    return calibrate(2, sizes=[2**12, 2**16, 2**20, 2**22], matmul_sizes=[256, 512], repeats=2)


def _row(name: str, profile, run_dir) -> dict:
    from meshtrain.commands.verify import run_layout
    from meshtrain.host.allocator import allocator_environment

    config = small_config(LAYOUTS[name], 2, run_dir=str(run_dir), **SHAPE)
    predicted = predict(config, 2, profile)
    hidden = predict(config, 2, dataclasses.replace(profile, comm_overlaps_compute=True))
    with allocator_environment():
        records = run_layout(config, 2, 4, spawn_single=True)[1:]  # first step: warm-up
    measured = statistics.median(r["wait_s"] / r["step_time_s"] for r in records)
    return {"layout": name, "predicted": _exposed_fraction(predicted),
            "overlapped_model": _exposed_fraction(hidden), "measured": measured,
            "overlap": predicted["overlap"]}


def _exposed_fraction(result: dict) -> float:
    exposed = (sum(axis["exposed_s"] for axis in result["overlap"].values())
               + result["breakdown"]["step_sync_s"])
    return exposed / result["step_time_s"]


def _outside(row: dict) -> bool:
    low = 0.0 if row["layout"] in ASYNC else row["predicted"] - TOLERANCE
    return not low <= row["measured"] <= row["predicted"] + TOLERANCE


def _table(rows: list[dict]) -> str:
    return "\n".join(f"{r['layout']:<14} exposed fraction: CPU profile {r['predicted']:.3f}, "
                     f"overlapping model {r['overlapped_model']:.3f}, measured "
                     f"{r['measured']:.3f}" for r in rows)


def test_exposed_communication_fraction_matches_the_measured_timeline(tmp_path):
    profile = _profile()
    rows = [_row(name, profile, tmp_path) for name in LAYOUTS]
    print(_table(rows))  # shown with -s / on failure
    # On a CPU nothing overlaps: every axis's exposed time is its whole communication.
    for row in rows:
        for axis in row["overlap"].values():
            assert axis["overlapped_s"] == 0.0
    outside = [r for r in rows if _outside(r)]
    if outside:  # one re-measurement: the machine is shared
        profile = _profile()
        outside = [_row(r["layout"], profile, tmp_path) for r in outside]
        print("re-measured:\n" + _table(outside))
        outside = [r for r in outside if _outside(r)]
    assert not outside, _table(outside)
