"""Measured costs for the planner: what ``parallel.replan_every`` timed, as a :class:`Cluster`.

The planner prices a layout from a hardware profile (:mod:`meshtrain.planner.cost.estimate`). A run
measures, per step, the seconds each rank spent in the collectives of every parallel axis and
the rest of its step (its compute, :mod:`meshtrain.replan.monitor`). This module turns
the two into *scales* for the layout that ran:

- **compute**: measured compute seconds / predicted ``compute_s + recompute_s + optimizer_s``.
  The part of the step no axis accounts for (data loading, Python) counts as compute, so every
  measured second is attributed somewhere;
- **each axis** ``dp``, ``tp``, ``pp``, ``ep``, ``cp`` that the layout uses: measured seconds in
  that axis's collectives / the predicted ``{axis}_comm_s`` (``dp_comm_exposed_s`` for dp). A
  pipeline rank waits in its receives during the fill and drain too, so for pp the predicted
  bubble (at the measured compute rate) is taken off the measured seconds first. Each axis's
  share of the step's small all-reduces (loss, gradient norm) counts with it. An axis the layout
  does not use (one rank) cannot be measured: it takes the smallest scale measured on another
  axis (the least slowed link seen on this machine), or 1 when none was.

:func:`measured_cluster` applies them to the profile the plan was priced with: its compute and
memory rates divided by the compute scale (its per-kernel overhead multiplied), and each axis's
collectives multiplied by the axis's scale (:attr:`Cluster.axis_scale`). Every candidate layout
is then priced by the same :func:`~meshtrain.planner.cost.estimate.estimate` as before, on that
cluster: no second cost model.
"""

from __future__ import annotations

import dataclasses

from meshtrain.planner.hardware.profile import Cluster

AXES = ("dp", "tp", "pp", "ep", "cp")
"""The parallel axes whose communication is measured and re-priced."""
COUNTED_AS = {"edp": "dp"}
"""Runtime comm names counted as another planner axis (expert-parallel data-parallel
reductions are data-parallel communication)."""
SCALE_RANGE = (1e-2, 1e4)
"""Scales are clipped to this range, so one odd measurement cannot price a link as free."""


def planner_axes(wait_by_axis: dict[str, float]) -> dict[str, float]:
    """Seconds per planner axis from the runtime's per-axis seconds (``CommLog.wait_by_axis``);
    other names (``world``, ``replica``: the run's own bookkeeping) are left out."""
    seconds = dict.fromkeys(AXES, 0.0)
    for name, value in wait_by_axis.items():
        axis = COUNTED_AS.get(name, name)
        if axis in seconds:
            seconds[axis] += value
    return seconds


def predicted_parts(result: dict) -> dict[str, float]:
    """An estimate's step split the way a run measures it: compute (with the optimizer step,
    the MoE balance pre-pass and offload's exposed host update and transfers, which a run does
    not time apart), each axis's communication, and the pipeline bubble (seconds)."""
    b, syncs = result["breakdown"], result.get("step_sync_by_axis_s", {})
    parts = {"compute": (b["compute_s"] + b["recompute_s"] + b["optimizer_s"]
                         + b.get("balance_prepass_s", 0.0) + b.get("offload_s", 0.0)),
             "dp": b["dp_comm_exposed_s"], "tp": b["tp_comm_s"], "pp": b["pp_comm_s"],
             "ep": b["ep_comm_s"], "cp": b["cp_comm_s"], "bubble": b["bubble_s"]}
    for axis, seconds in syncs.items():  # the loss's and gradient norm's small all-reduces
        parts[axis] += seconds
    return parts


def _clip(value: float) -> float:
    low, high = SCALE_RANGE
    return min(max(value, low), high)


def measured_scales(result: dict, step_s: float, axis_s: dict[str, float]) -> dict[str, float]:
    """``{"compute": s, axis: s, ...}``: measured / predicted for the layout ``result`` priced
    (see the module doc); ``step_s`` is the measured step time, ``axis_s`` the measured seconds
    per planner axis (:func:`planner_axes`)."""
    parts = predicted_parts(result)
    attributed = {axis: axis_s.get(axis, 0.0) for axis in AXES if parts[axis] > 0}
    compute_s = max(step_s - sum(attributed.values()), 0.0)
    compute = _clip(compute_s / parts["compute"]) if parts["compute"] > 0 else 1.0
    scales = {"compute": compute}
    for axis, seconds in attributed.items():
        if axis == "pp":
            seconds = max(seconds - compute * parts["bubble"], 0.0)
        scales[axis] = _clip(seconds / parts[axis])
    links = [scales[axis] for axis in attributed]
    for axis in AXES:  # not used by this layout: priced like its least slowed measured link
        scales.setdefault(axis, min(links) if links else 1.0)
    return scales


def measured_cluster(cluster: Cluster, scales: dict[str, float]) -> Cluster:
    """``cluster`` with :func:`measured_scales` applied (see the module doc)."""
    p, s = cluster.profile, scales.get("compute", 1.0)
    profile = dataclasses.replace(
        p, name=f"{p.name} (measured)", peak_tflops=p.peak_tflops / s, hbm_gbps=p.hbm_gbps / s,
        solo_tflops=p.solo_tflops / s, solo_hbm_gbps=p.solo_hbm_gbps / s,
        kernel_overhead_us=p.kernel_overhead_us * s)
    axes = tuple((axis, value) for axis, value in scales.items() if axis in AXES)
    return dataclasses.replace(cluster, profile=profile, axis_scale=axes)
