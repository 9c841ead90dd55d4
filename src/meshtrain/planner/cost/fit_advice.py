"""Why a priced layout does not fit, and what would shrink it: ``estimate``'s ``why_not_fits``.

:func:`why_not_fits` takes an estimate that does not fit and names the largest part of its
fullest stage's memory (activations, parameters, gradients, optimizer state or buffers, as
:class:`~meshtrain.planner.cost.memory.RankMemory` counts them), then prices the changes that
shrink that part and this layout can make on the same GPUs: a smaller micro-batch (more
micro-batches), activation checkpointing, sequence parallelism, a higher ZeRO stage, twice the
tp, pp or cp (with half the dp). A change is listed only when it applies (ZeRO-3 is never
proposed at ZeRO-3, nor ZeRO at dp × cp = 1, nor what the priced stack does not offer) and the
cost model accepts the changed layout; each comes with the peak it would have.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ConfigError
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.memory import GB
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


def _changes(workload: Workload, lay: Layout, cluster: Cluster, largest: str) -> list[tuple]:
    """``(settings, why, layout)`` of each change that shrinks ``largest``, not yet checked."""
    traits, out = workload.traits, []
    part = "optimizer state" if largest == "optimizer" else largest
    b = lay.micro_batch_size(workload.global_batch)
    sharded_over = lay.dp * lay.cp

    def add(settings: dict, why: str) -> None:
        out.append((settings, why, dataclasses.replace(lay, **settings)))

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


def _priced(workload: Workload, layout: Layout, cluster: Cluster, stack: str) -> dict | None:
    """The closed-form estimate of ``layout``, or None when the cost model or the stack
    refuses it."""
    from meshtrain.planner.cost.estimate import estimate

    try:
        check_layout(workload, layout)
        check_stack_offers(workload, layout, stack)
        return estimate(workload, layout, cluster, use_simulator=False)
    except ConfigError:
        return None


def _largest(result: dict) -> tuple[dict, str]:
    """The fullest stage's ``per_rank`` entry and its largest component."""
    fullest = max(result["per_rank"], key=lambda rank: rank["total_bytes"])
    return fullest, max(SHRINKABLE, key=lambda name: fullest[COMPONENTS[name]])


def _settings(layout: Layout, changed: Layout) -> list[str]:
    """``parallel.KEY=VALUE`` for each field ``changed`` sets differently from ``layout``."""
    return [f"parallel.{f.name}={str(getattr(changed, f.name)).lower()}"
            for f in dataclasses.fields(Layout)
            if getattr(changed, f.name) != getattr(layout, f.name)]


def _together(workload: Workload, layout: Layout, cluster: Cluster, result: dict,
              stack: str, steps: int = 4) -> tuple[Layout, dict] | None:
    """Greedily combined changes: at most ``steps`` times, the change that lowers the peak most
    (re-chosen for what is then the largest part), until it fits; None unless it took two."""
    current, priced, taken = layout, result, 0
    while not priced["fits"] and taken < steps:
        best = None
        for _, _, changed in _changes(workload, current, cluster, _largest(priced)[1]):
            candidate = _priced(workload, changed, cluster, stack)
            if candidate and candidate["memory_gb_per_gpu"] < (
                    best[1] if best else priced)["memory_gb_per_gpu"]:
                best = (changed, candidate)
        if best is None:
            break
        (current, priced), taken = best, taken + 1
    return (current, priced) if taken > 1 else None


def why_not_fits(workload: Workload, layout: Layout, cluster: Cluster, result: dict,
                 stack: str = "meshtrain") -> dict | None:
    """None when ``result`` (:func:`~meshtrain.planner.cost.estimate.estimate` of ``layout``)
    fits; else its fullest stage's memory by component (GB: :data:`COMPONENTS`, the
    fragmentation reserve included), the largest, the capacity and the estimate, and
    ``suggestions``: each applicable change that lowers the peak (``set``: the ``--set``
    values, ``why``, ``estimate_gb``: the peak it would have, ``fits``), and, when none fits
    alone, the changes that together lower it most; those that fit first."""
    if result["fits"]:
        return None
    fullest, largest = _largest(result)
    parts = {name: round(fullest.get(key, 0) / GB, 1) for name, key in COMPONENTS.items()}
    suggestions = []
    for _, why, changed in _changes(workload, layout, cluster, largest):
        priced = _priced(workload, changed, cluster, stack)
        if priced is None or priced["memory_gb_per_gpu"] >= result["memory_gb_per_gpu"]:
            continue
        suggestions.append({"set": _settings(layout, changed), "why": why,
                            "estimate_gb": round(priced["memory_gb_per_gpu"], 1),
                            "fits": priced["fits"]})
    if not any(s["fits"] for s in suggestions):
        together = _together(workload, layout, cluster, result, stack)
        if together is not None:
            changed, priced = together
            suggestions.append({"set": _settings(layout, changed), "why": "these together",
                                "estimate_gb": round(priced["memory_gb_per_gpu"], 1),
                                "fits": priced["fits"]})
    suggestions.sort(key=lambda s: (not s["fits"], s["estimate_gb"]))
    return {**parts, "largest": largest, "stage": fullest["stage"],
            "stages": len(result["per_rank"]),
            "capacity_gb": round(result["memory_limit_gb"], 1),
            "estimate_gb": round(result["memory_gb_per_gpu"], 1), "suggestions": suggestions}


def format_why_not_fits(why: dict) -> list[str]:
    """The text report's lines: the largest part and each suggestion with its peak."""
    stage = f" (stage {why['stage']}, the fullest)" if why["stages"] > 1 else ""
    lines = [f"why: {why['largest']} are the largest part{stage}, {why[why['largest']]:,.1f} of "
             f"{why['estimate_gb']:,.1f} GB; {why['capacity_gb']:,.1f} GB usable",
             "  by component (GB): " + ", ".join(f"{NAMES[name]} {why.get(name, 0.0):,.1f}"
                                                 for name in COMPONENTS)]
    if why["largest"] == "optimizer":
        lines[0] = lines[0].replace("optimizer are", "optimizer state is")
    for s in why["suggestions"]:
        verdict = "fits" if s["fits"] else "still does not fit"
        lines.append(f"  --set {' --set '.join(s['set'])}: peak {s['estimate_gb']:,.1f} GB, "
                     f"{verdict} ({s['why']})")
    if not any(s["fits"] for s in why["suggestions"]):
        lines.append("  no change tried here fits on these GPUs: more GPUs, a shorter sequence "
                     "or a smaller global batch (meshtrain plan searches every layout)")
    return lines
