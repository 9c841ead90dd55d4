"""Why a priced layout does not fit, and what would shrink it: ``estimate``'s ``why_not_fits``.

:func:`why_not_fits` takes an estimate that does not fit and names the largest part of its
fullest stage's memory (activations, parameters, gradients, optimizer state or buffers, as
:class:`~meshtrain.planner.cost.memory.RankMemory` counts them), then prices the changes that
shrink that part and this layout can make on the same GPUs: a smaller micro-batch (more
micro-batches), activation checkpointing, sequence parallelism, a higher ZeRO stage, twice the
tp, pp or cp (with half the dp), and offload (``parallel.offload``: the optimizer state, or
at ZeRO-3 the parameter shard too, in host memory) for the optimizer state or parameters. A
change is listed only when it applies (ZeRO-3 is never proposed at ZeRO-3, nor ZeRO or offload
at dp × cp = 1, nor what the priced stack does not offer) and the cost model accepts the
changed layout; each comes with the peak it would have. Under offload a layout the GPUs hold
can still not fit the node (its host memory or drives,
:mod:`meshtrain.planner.cost.offload`): the largest part is then ``host``, named with the
numbers, and the changes tried are the NVMe drives instead of host memory and the optimizer
state alone instead of the parameters too.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ConfigError
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.memory import GB
from meshtrain.planner.cost.offload import NO_OFFLOAD, Offload, capacity_text
from meshtrain.planner.cost.workload import Workload, check_layout, check_stack_offers
from meshtrain.planner.hardware.profile import Cluster

COMPONENTS = {"activations": "activation_bytes", "parameters": "param_bytes",
              "gradients": "grad_bytes", "optimizer": "optim_bytes", "buffers": "buffer_bytes",
              "reserve": "reserve_bytes"}
"""``why_not_fits`` component -> the ``per_rank`` key it is read from (``reserve``: the caching
allocator's fragmentation reserve, ``HardwareProfile.allocator_reserve`` of the rest)."""

SHRINKABLE = ("activations", "parameters", "gradients", "optimizer", "buffers")
"""The components a layout change can shrink directly (the reserve follows the rest)."""

NAMES = {"activations": "activations", "parameters": "parameters", "gradients": "gradients",
         "optimizer": "optimizer state", "buffers": "buffers",
         "reserve": "fragmentation reserve"}
"""How the text report names each component."""


def _changes(workload: Workload, lay: Layout, cluster: Cluster, largest: str,
             offload: Offload = NO_OFFLOAD) -> list[tuple]:
    """``(settings, why, layout, offload)`` of each change that shrinks ``largest`` (``host``:
    the node's host memory or drives under ``offload``), not yet checked."""
    traits, out = workload.traits, []
    part = "optimizer state" if largest == "optimizer" else largest
    b = lay.micro_batch_size(workload.global_batch)
    sharded_over = lay.dp * lay.cp

    def add(settings: dict, why: str, moved: Offload = offload) -> None:
        out.append((settings, why, dataclasses.replace(lay, **settings), moved))

    if largest == "host":
        if offload.device == "host" and cluster.profile.nvme_tb:
            add({}, "keep the offloaded state in NVMe files instead of host memory",
                dataclasses.replace(offload, device="nvme"))
        if offload.params:
            add({}, "offload the optimizer state only (the parameter shard stays on the GPU)",
                dataclasses.replace(offload, kind="optimizer"))
        return out
    if traits.offload and sharded_over > 1 and largest in ("optimizer", "parameters"):
        overlap = cluster.profile.comm_overlaps_compute
        if largest == "optimizer" and not offload.active:
            add({"zero": max(lay.zero, 1)}, "keep the optimizer state in host memory",
                Offload("optimizer", offload.device, overlap and lay.zero == 3))
        if largest == "parameters" and not offload.params:
            add({"zero": 3}, "keep the parameter shard and optimizer state in host memory",
                Offload("optimizer+params", offload.device, overlap))

    def halve_dp(key: str, why: str) -> None:
        doubled = getattr(lay, key) * 2
        if lay.dp % 2 or (key == "tp" and doubled > cluster.gpus_per_node):
            return
        # twice the micro-batches keep the micro-batch size (half the dp: twice the sequences)
        add({key: doubled, "dp": lay.dp // 2, "microbatches": lay.microbatches * 2}, why)

    if largest in ("activations", "buffers") and b > 1:
        add({"microbatches": lay.microbatches * b},
            f"micro-batch 1 instead of {b}: activations scale with the micro-batch")
    if largest == "activations":
        for mode in ("selective", "full"):
            order = ("none", "selective", "full")
            if (order.index(mode) > order.index(lay.activation_checkpointing)
                    and mode in traits.checkpointing):
                add({"activation_checkpointing": mode},
                    "recompute in backward instead of keeping "
                    + ("the attention core's activations" if mode == "selective"
                       else "each block's activations"))
        if lay.tp > 1 and not lay.sequence_parallel and traits.sequence_parallel:
            add({"sequence_parallel": True},
                "split the activations between the tp regions (norms, residuals) over tp")
        if traits.context_parallel:
            halve_dp("cp", "split each sequence over twice the ranks")
    stage_needed = {"optimizer": 1, "gradients": 2, "parameters": 3}.get(largest)
    if stage_needed and lay.zero < stage_needed and sharded_over > 1:
        stage = min((z for z in traits.zero_stages if z >= stage_needed), default=None)
        if stage is not None:
            add({"zero": stage}, f"shard the {part} over the {sharded_over} data-parallel ranks")
    if largest != "buffers" or lay.tp > 1:
        halve_dp("tp", f"split each layer's {part} over twice the ranks")
    if largest in ("parameters", "gradients", "optimizer"):
        halve_dp("pp", f"split the layers, and their {part}, over twice the stages")
    return out


def _priced(workload: Workload, layout: Layout, cluster: Cluster, stack: str,
            offload: Offload = NO_OFFLOAD, replicas: int = 1) -> dict | None:
    """The closed-form estimate of ``layout``, or None when the cost model or the stack
    refuses it."""
    from meshtrain.planner.cost.estimate import estimate

    try:
        check_layout(workload, layout)
        check_stack_offers(workload, layout, stack)
        return estimate(workload, layout, cluster, use_simulator=False, offload=offload,
                        replicas=replicas)
    except ConfigError:
        return None


def _device_fits(result: dict) -> bool:
    """Whether the devices hold the layout (whatever the host and drives say)."""
    return result["memory_gb_per_gpu"] <= result["memory_limit_gb"]


def _largest(result: dict) -> tuple[dict, str]:
    """The fullest stage's ``per_rank`` entry and its largest component (``host`` when the
    devices hold the layout but the node's host memory or drives do not)."""
    fullest = max(result["per_rank"], key=lambda rank: rank["total_bytes"])
    if _device_fits(result) and result.get("offload"):
        return fullest, "host"
    return fullest, max(SHRINKABLE, key=lambda name: fullest[COMPONENTS[name]])


def _settings(layout: Layout, changed: Layout, offload: Offload = NO_OFFLOAD,
              moved: Offload = NO_OFFLOAD) -> list[str]:
    """``parallel.KEY=VALUE`` for each field ``changed`` sets differently from ``layout``, and
    each offload setting ``moved`` sets differently from ``offload``."""
    out = [f"parallel.{f.name}={str(getattr(changed, f.name)).lower()}"
           for f in dataclasses.fields(Layout)
           if getattr(changed, f.name) != getattr(layout, f.name)]
    if moved != offload:
        out += [text for text in moved.settings() if text not in offload.settings()]
        if offload.overlap and not moved.overlap:
            out.append("parallel.offload_overlap=false")
    return out


def _badness(result: dict) -> tuple[bool, float]:
    """What a change must lower, worst first: not fitting the devices, then the device peak
    or, once the devices hold it under offload, what the node must hold (host and drives,
    GB)."""
    cost = result.get("offload")
    if _device_fits(result) and cost:
        return False, (cost["host_gb_per_node"] or 0.0) + (cost["nvme_gb_per_node"] or 0.0)
    return not _device_fits(result), result["memory_gb_per_gpu"]


def _together(workload: Workload, layout: Layout, cluster: Cluster, result: dict,
              stack: str, offload: Offload, replicas: int,
              steps: int = 4) -> tuple[Layout, Offload, dict] | None:
    """Greedily combined changes: at most ``steps`` times, the change that lowers the peak most
    (re-chosen for what is then the largest part), until it fits; None unless it took two.
    Offload is the last resort: the changes that keep ``offload`` as it is are combined first,
    and only when they do not fit within ``steps`` are offload changes allowed too (offload
    moves the update to the host and adds transfers, so a layout change that fits is
    preferred)."""
    kept = _greedy(workload, layout, cluster, result, stack, offload, replicas, steps, False)
    if kept is not None and kept[2]["fits"]:
        return kept
    return _greedy(workload, layout, cluster, result, stack, offload, replicas, steps, True)


def _greedy(workload: Workload, layout: Layout, cluster: Cluster, result: dict, stack: str,
            offload: Offload, replicas: int, steps: int,
            allow_offload: bool) -> tuple[Layout, Offload, dict] | None:
    """:func:`_together`'s walk, with or without changes to the offload settings."""
    current, moved, priced, taken = layout, offload, result, 0
    while not priced["fits"] and taken < steps:
        best = None
        for *_, changed, tried in _changes(workload, current, cluster, _largest(priced)[1],
                                           moved):
            if tried != moved and not allow_offload:
                continue
            candidate = _priced(workload, changed, cluster, stack, tried, replicas)
            if candidate and _badness(candidate) < _badness(best[2] if best else priced):
                best = (changed, tried, candidate)
        if best is None:
            break
        (current, moved, priced), taken = best, taken + 1
    return (current, moved, priced) if taken > 1 else None


def _suggestion(layout: Layout, offload: Offload, changed: Layout, moved: Offload, why: str,
                priced: dict) -> dict:
    """One ``suggestions`` entry: the ``--set`` values of the change, why, and what it gives."""
    cost = priced.get("offload")
    host = cost and cost["host_gb_per_node"]
    return {"set": _settings(layout, changed, offload, moved), "why": why,
            "estimate_gb": round(priced["memory_gb_per_gpu"], 1), "fits": priced["fits"],
            "host_gb_per_node": round(host, 1) if host else None}


def why_not_fits(workload: Workload, layout: Layout, cluster: Cluster, result: dict,
                 stack: str = "meshtrain", offload: Offload = NO_OFFLOAD,
                 replicas: int = 1) -> dict | None:
    """None when ``result`` (:func:`~meshtrain.planner.cost.estimate.estimate` of ``layout``
    with ``offload``) fits; else its fullest stage's memory by component (GB:
    :data:`COMPONENTS`, the fragmentation reserve included), the largest (``host`` when the
    devices hold it but the node's host memory or drives do not), the capacity and the
    estimate, ``offload`` (what the node must hold under offload against what it has, with
    the text naming the numbers; None without offload), and ``suggestions``: each applicable
    change that lowers the peak (``set``: the ``--set`` values, ``why``, ``estimate_gb``: the
    device peak it would have, ``fits``), and, when none fits alone, the changes that together
    lower it most; those that fit first."""
    if result["fits"]:
        return None
    fullest, largest = _largest(result)
    parts = {name: round(fullest.get(key, 0) / GB, 1) for name, key in COMPONENTS.items()}
    suggestions = []
    for _, why, changed, moved in _changes(workload, layout, cluster, largest, offload):
        priced = _priced(workload, changed, cluster, stack, moved, replicas)
        if priced is None or not (priced["fits"] or _badness(priced) < _badness(result)):
            continue
        suggestions.append(_suggestion(layout, offload, changed, moved, why, priced))
    if not any(s["fits"] for s in suggestions):
        together = _together(workload, layout, cluster, result, stack, offload, replicas)
        if together is not None:
            suggestions.append(_suggestion(layout, offload, *together[:2], "these together",
                                           together[2]))
    suggestions.sort(key=lambda s: (not s["fits"], s["estimate_gb"]))
    cost = result.get("offload")
    node = None
    if cost:
        node = {key: cost[key] for key in ("host_gb_per_node", "host_limit_gb", "host_memory_gb",
                                           "host_fits", "nvme_gb_per_node", "nvme_limit_gb",
                                           "nvme_fits", "ranks_per_node")}
        node["text"] = capacity_text(cost)
    return {**parts, "largest": largest, "stage": fullest["stage"],
            "stages": len(result["per_rank"]),
            "capacity_gb": round(result["memory_limit_gb"], 1),
            "estimate_gb": round(result["memory_gb_per_gpu"], 1), "offload": node,
            "suggestions": suggestions}


def format_why_not_fits(why: dict) -> list[str]:
    """The text report's lines: the largest part and each suggestion with its peak."""
    stage = f" (stage {why['stage']}, the fullest)" if why["stages"] > 1 else ""
    if why["largest"] == "host":
        lines = [f"why: the GPUs hold it ({why['estimate_gb']:,.1f} of {why['capacity_gb']:,.1f}"
                 f" GB) but the node does not: {why['offload']['text']}"]
    else:
        lines = [f"why: {why['largest']} are the largest part{stage}, "
                 f"{why[why['largest']]:,.1f} of {why['estimate_gb']:,.1f} GB; "
                 f"{why['capacity_gb']:,.1f} GB usable",
                 "  by component (GB): " + ", ".join(f"{NAMES[name]} {why.get(name, 0.0):,.1f}"
                                                     for name in COMPONENTS)]
    if why["largest"] == "optimizer":
        lines[0] = lines[0].replace("optimizer are", "optimizer state is")
    for s in why["suggestions"]:
        verdict = "fits" if s["fits"] else "still does not fit"
        host = (f", host {s['host_gb_per_node']:,.0f} GB per node"
                if s.get("host_gb_per_node") else "")
        lines.append(f"  --set {' --set '.join(s['set'])}: peak {s['estimate_gb']:,.1f} GB"
                     f"{host}, {verdict} ({s['why']})")
    if not any(s["fits"] for s in why["suggestions"]):
        lines.append("  no change tried here fits on these GPUs: more GPUs, a shorter sequence "
                     "or a smaller global batch (meshtrain plan searches every layout)")
    return lines
