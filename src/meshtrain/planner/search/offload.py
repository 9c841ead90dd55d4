"""Offload in the search: which offload settings ``plan`` tries for a layout, and what it says
when offload is what makes a layout fit, or when not even offload does.

Offload only ever adds work to a step (the update moves to the host, state crosses PCIe or
the drives), so the same layout is never faster with it; what it can do is make a layout fit
that does not fit without it. ``plan`` therefore searches offload only where it can help:
with ``--offload auto`` (the default) only when no layout fits without it, with ``--offload
always`` also beside layouts that fit (an offloaded layout can then still win, when it avoids
activation checkpointing or a deep pipeline); ``--offload never`` leaves it out. For each
layout that does not fit at ZeRO 1-3 (and each pipelined ZeRO-1 layout also at ZeRO-3, which
the plain search prices only where it fits) it tries ``optimizer`` and, at ZeRO-3,
``optimizer+params``: in host memory, and on the NVMe drives where the host cannot hold it;
overlapped at ZeRO-3 on GPUs (the model never prices the overlap slower). A layout whose
activations and buffers alone exceed the device is not tried.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config.layout import Layout
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.memory import GB
from meshtrain.planner.cost.offload import Offload, capacity_text
from meshtrain.planner.cost.workload import Workload
from meshtrain.planner.hardware.profile import Cluster

OFFLOAD_MODES = ("auto", "always", "never")
"""``plan --offload``: search offload when nothing fits without it, beside every layout, or
not at all."""


def options(workload: Workload, cluster: Cluster, layout: Layout) -> list[Offload]:
    """The offload settings tried for ``layout`` in host memory (``nvme`` follows where the
    host cannot hold them, :func:`price_offloaded`)."""
    if (not workload.traits.offload or layout.zero == 0 or layout.dp * layout.cp == 1
            or cluster.wan is not None):
        return []
    overlap = layout.zero == 3 and cluster.profile.comm_overlaps_compute
    kinds = ["optimizer"] + (["optimizer+params"] if layout.zero == 3 else [])
    return [Offload(kind, "host", overlap) for kind in kinds]


def _room(result: dict) -> bool:
    """Whether offload could make ``result`` fit: its activations and buffers fit the device."""
    limit = result["memory_limit_gb"] * GB
    return all(r["activation_bytes"] + r["buffer_bytes"] < limit for r in result["per_rank"])


def price_offloaded(workload: Workload, cluster: Cluster, priced: list[tuple[Layout, dict]],
                    energy: dict | None = None) -> list[tuple[Layout, Offload, dict]]:
    """``(layout, offload, closed-form estimate)`` of each offload setting tried for the
    layouts of ``priced`` that do not fit (see the module doc)."""
    seen = {repr(layout) for layout, _ in priced}
    bases = []
    for layout, result in priced:
        if result["fits"] or not _room(result):
            continue
        bases.append(layout)
        sharded = dataclasses.replace(layout, zero=3)
        if layout.pp > 1 and layout.zero == 1 and repr(sharded) not in seen:
            seen.add(repr(sharded))
            bases.append(sharded)
    out = []
    for layout in bases:
        for offload in options(workload, cluster, layout):
            result = estimate(workload, layout, cluster, energy, use_simulator=False,
                              offload=offload)
            if not result["offload"]["host_fits"] and cluster.profile.nvme_tb:
                offload = dataclasses.replace(offload, device="nvme")
                result = estimate(workload, layout, cluster, energy, use_simulator=False,
                                  offload=offload)
            out.append((layout, offload, result))
    return out


def cost_text(result: dict) -> str:
    """What offload costs a candidate, for its ``why`` line ("" without offload)."""
    cost = result.get("offload")
    if not cost:
        return ""
    share = cost["exposed_s"] / result["step_time_s"]
    return (f"offload {Offload.from_json(cost).describe()}: +{cost['exposed_s']:.3g}s per step "
            f"({share:.1%}: host AdamW {cost['adamw_s']:.3g}s, PCIe {cost['pcie_s']:.3g}s, "
            f"NVMe {cost['nvme_s']:.3g}s"
            + (f", {cost['hidden_s']:.3g}s hidden" if cost["overlap"] else "") + ")")


def offload_note(searched: int, fitted: int, without: int, mode: str) -> str:
    """The line ``plan`` prints about the offload it searched."""
    if mode == "always":
        return (f"offload searched beside every layout (--offload always): {searched} settings "
                f"priced, {fitted} fit")
    return (f"nothing fits without offload ({without} layouts); with offload {fitted} of "
            f"{searched} priced settings fit"
            + (" (what it costs: the offload part of each line)" if fitted else ""))


def why_offload_does_not_fit(priced: list[tuple[Layout, Offload, dict]]) -> str:
    """Why no offloaded layout fits either, with the numbers: the device memory of the leanest
    one, or the host memory and drive space of the one that fits the devices with the least
    host need."""
    if not priced:
        return ("Offload cannot help: every layout's activations and buffers alone exceed the "
                "device memory (or no layout shards a ZeRO state to offload).")
    on_device = [r for _, _, r in priced if r["memory_gb_per_gpu"] <= r["memory_limit_gb"]]
    if not on_device:
        lean = min((r for _, _, r in priced), key=lambda r: r["memory_gb_per_gpu"])
        return (f"With offload the leanest layout still needs {lean['memory_gb_per_gpu']:.0f} GB "
                f"per GPU of {lean['memory_limit_gb']:.0f} GB usable "
                f"({Offload.from_json(lean['offload']).describe()}).")
    best = min(on_device, key=lambda r: (r["offload"]["host_gb_per_node"] or 0.0,
                                         r["offload"]["nvme_gb_per_node"] or 0.0))
    lay = best["layout"]
    return (f"With offload dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} cp={lay['cp']} "
            f"zero={lay['zero']} ({Offload.from_json(best['offload']).describe()}) fits the GPUs "
            f"({best['memory_gb_per_gpu']:.0f} GB each) but not the node: "
            f"{capacity_text(best['offload'])}.")
