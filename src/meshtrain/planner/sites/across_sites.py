"""Training across sites: what ``estimate`` says about the wide-area link, and what ``plan``
proposes for it (synchronous data parallelism or DiLoCo replica groups).

``plan`` on a cluster split into sites (:mod:`meshtrain.planner.sites.wide_area`) ranks synchronous
layouts as always (their collectives that span sites priced on the wide-area link), then
searches DiLoCo: replicas over the divisors of the site count above 1 (one group per site, or
per few sites), each group's inner layout among the fastest that fit on its share of the
cluster, ``parallel.sync_every`` in :data:`SYNC_EVERY_CHOICES` and ``parallel.sync_fragments``
in :data:`FRAGMENT_CHOICES`, priced by
:func:`meshtrain.planner.sites.diloco_cost.estimate_replicated`.
A longer round always moves fewer bytes but lets the groups drift further apart, which the cost
model does not see, so the proposal takes the shortest round (then the fewest fragments) whose
speed is within :data:`ROUND_SLACK` of the fastest DiLoCo option; DiLoCo is proposed when that
is at least :data:`DILOCO_MIN_GAIN` times as fast as the best synchronous layout. The saving is
reported against synchronous data parallelism over the same ranks: the proposal's inner layout
with the replica groups folded into ``dp``, at the ZeRO stage that runs it fastest (among those
that fit).
"""

from __future__ import annotations

import dataclasses
import math

from meshtrain.config.layout import Layout
from meshtrain.config.layout_rules import ALL_REDUCE_OUTER_DTYPES, max_sync_fragments
from meshtrain.config.runtime_facts import bus_bytes
from meshtrain.planner.cost.context_parallel import reduction_group
from meshtrain.planner.cost.memory import stage_params
from meshtrain.planner.cost.workload import Workload, layout_from_json, stage_layers
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.search.layouts import candidate_row, enumerate_layouts, price_layouts
from meshtrain.planner.sites.diloco_cost import (
    ReplicaSettings,
    estimate_replicated,
    inner_cluster,
    inner_workload,
)
from meshtrain.planner.sites.wide_area import spans_sites

SYNC_EVERY_CHOICES = (10, 20, 50, 100, 500)
FRAGMENT_CHOICES = (1, 2, 4)
INNER_CANDIDATES = 3
"""Fastest inner layouts per replica count tried with every round length."""
ROUND_SLACK = 0.05
DILOCO_MIN_GAIN = 1.10
CONVERGENCE_NOTE = (
    "DiLoCo changes the optimisation: each group takes H AdamW steps on its own data between "
    "outer steps. The planner prices time and traffic, not convergence. Douillard et al. 2023 "
    "report a loss equal to or better than synchronous training on C4 with 8 workers at "
    "H = 500 (500 times less communication); check the loss at the chosen H on your data "
    "(docs/diloco.md).")


def dp_bus_bytes(workload: Workload, layout: Layout) -> int:
    """Bus bytes per rank and step of data-parallel gradient (and ZeRO parameter) traffic on
    the first pipeline stage, as :func:`meshtrain.planner.cost.estimate` prices it."""
    lay, traits = layout, workload.traits
    layers = stage_layers(workload.model, lay)[0]
    sp = stage_params(workload.model, layers, lay, True, lay.pp == 1)
    n = reduction_group(lay)[0]
    total = 0
    for params, size in ((sp.dense, n), (sp.expert, n // lay.ep)):
        grads = int(params * traits.grad_reduce_bytes)
        weights = int(params * workload.act_bytes)
        m = lay.microbatches
        if lay.zero == 0:
            total += bus_bytes("all_reduce", grads, size)
        elif lay.zero == 1:
            total += bus_bytes("reduce_scatter", grads, size) + bus_bytes("all_gather", weights,
                                                                        size)
        elif lay.zero == 2:
            total += (m * bus_bytes("reduce_scatter", grads, size)
                      + bus_bytes("all_gather", weights, size))
        else:
            total += m * (2 * bus_bytes("all_gather", weights, size)
                          + bus_bytes("reduce_scatter", grads, size))
    return total


def crossing_axes(layout: Layout, cluster: Cluster) -> list[str]:
    """The inner layout's axes whose groups span sites on ``cluster``."""
    lay = layout
    groups = {"dp": reduction_group(lay), "tp": (lay.tp, 1), "cp": (lay.cp, lay.tp),
              "pp": (lay.pp, lay.tp * lay.cp * lay.dp), "ep": (lay.ep, lay.tp * lay.cp)}
    return [axis for axis, (size, stride) in groups.items()
            if spans_sites(cluster.wan, cluster.gpus, size, stride)]


def describe_sites(workload: Workload, layout: Layout, cluster: Cluster, result: dict) -> dict:
    """``estimate``'s ``wide_area`` section: the sites, which traffic crosses the link, and
    (synchronous dp spanning sites) its gradient bytes and seconds per step."""
    replicas = result.get("replicas", {}).get("replicas", 1)
    inner = inner_cluster(cluster, replicas) if replicas > 1 else cluster
    wan = cluster.wan
    section = {"sites": cluster.sites, "gpus_per_site": cluster.gpus // cluster.sites,
               "wan_gbps": wan.wan_gbps if wan else None,
               "wan_latency_ms": wan.wan_latency_ms if wan else None,
               "crossing": crossing_axes(layout, inner)}
    if replicas > 1 and spans_sites(wan, cluster.gpus, replicas, cluster.gpus // replicas):
        section["crossing"].insert(0, "replica")
    if "dp" in section["crossing"]:
        section["dp_comm_bytes"] = dp_bus_bytes(workload if replicas == 1 else
                                                inner_workload(workload, replicas), layout)
    return section


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def format_sites(result: dict) -> str:
    """``estimate``'s lines about the sites and the replica groups."""
    w = result["wide_area"]
    lines = []
    if w["sites"] > 1:
        lines.append(f"sites: {w['sites']} x {w['gpus_per_site']} GPUs, wide-area link "
                     f"{w['wan_gbps']:g} Gb/s per site, {w['wan_latency_ms']:g} ms; crossing it: "
                     + (", ".join(w["crossing"]) or "nothing"))
    if "dp_comm_bytes" in w:
        b = result["breakdown"]
        lines.append(f"data parallelism spans the sites: {_mb(w['dp_comm_bytes'])} of gradient "
                     f"traffic per rank per step on the wide-area link, dp comm "
                     f"{b['dp_comm_total_s']:.3g}s per step ({b['dp_comm_exposed_s']:.3g}s "
                     "exposed)")
    if "replicas" in result:
        s = result["replicas"]
        lines += [
            f"DiLoCo: {s['replicas']} replica groups, sync_every {s['sync_every']}, "
            f"{s['sync_fragments']} fragment(s), {s['outer_grad_dtype']} pseudo-gradients: "
            f"{_mb(result['replica_round_bytes'])} per rank per round (largest sync "
            f"{_mb(result['replica_sync_bytes_max'])}), {_mb(result['replica_comm_bytes'])} per "
            f"step amortised",
            f"replica comm {result['replica_comm_s']:.3g}s per step, "
            f"{result['replica_comm_exposed_s']:.3g}s exposed ("
            + (f"each exchange overlaps the next {s['sync_overlap']} inner steps"
               if s["sync_overlap"] else "fragments sync between steps")
            + f"); inner step {result['inner_step_time_s']:.3g}s",
            CONVERGENCE_NOTE]
    return "\n".join(lines)


def _diloco_options(workload: Workload, cluster: Cluster, replicas: int, dtype: str,
                    energy: dict | None) -> list[dict]:
    """Every (inner layout, H, F) priced for ``replicas`` groups."""
    group, work = inner_cluster(cluster, replicas), inner_workload(workload, replicas)
    layouts = enumerate_layouts(work, group)
    inner = sorted((r for _, r in price_layouts(work, group, layouts, energy) if r["fits"]),
                   key=lambda r: -r["tokens_per_s"])[:INNER_CANDIDATES]
    options = []
    for result in inner:
        layout = layout_from_json(result["layout"])
        for every in SYNC_EVERY_CHOICES:
            for fragments in FRAGMENT_CHOICES:
                if fragments > max_sync_fragments(every, workload.model.n_layers):
                    continue
                settings = ReplicaSettings(replicas, every, fragments, dtype)
                blocking = estimate_replicated(workload, layout, cluster, settings, energy,
                                               inner=result)
                options.append(blocking)
                overlap = _hiding_overlap(blocking, every, dtype, cluster)
                if overlap:
                    settings = dataclasses.replace(settings, sync_overlap=overlap)
                    options.append(estimate_replicated(workload, layout, cluster, settings,
                                                       energy, inner=result))
    return options


def _hiding_overlap(blocking: dict, every: int, dtype: str, cluster: Cluster) -> int:
    """The least ``parallel.sync_overlap`` whose inner steps cover the longest fragment's
    exchange (below ``every``), or 0 where none can run in the background (a CPU profile,
    8-bit exchange, one step per round)."""
    if (every < 2 or dtype not in ALL_REDUCE_OUTER_DTYPES
            or not cluster.profile.comm_overlaps_compute):
        return 0
    inner = max(blocking["inner_step_time_s"], 1e-12)
    return min(every - 1, max(1, math.ceil(blocking["replica_sync_s_max"] / inner)))


def _option_row(priced: dict) -> dict:
    row = candidate_row(priced)
    row.update(priced["replicas"])
    for key in ("replica_comm_bytes", "replica_round_bytes", "replica_sync_bytes_max",
                "replica_comm_s", "replica_comm_exposed_s", "inner_step_time_s"):
        row[key] = priced[key]
    return row


def plan_across_sites(workload: Workload, cluster: Cluster, synchronous: list[dict],
                      outer_grad_dtype: str = "fp32", energy: dict | None = None) -> dict:
    """``plan``'s ``across_sites`` section (see the module doc); ``synchronous``: the ranked
    synchronous candidates of :func:`meshtrain.planner.search.layouts.plan` on ``cluster``."""
    sites = cluster.sites
    options = []
    for replicas in (r for r in range(2, sites + 1) if sites % r == 0):
        if workload.global_batch % replicas == 0:
            options += _diloco_options(workload, cluster, replicas, outer_grad_dtype, energy)
    best_sync = max(synchronous, key=lambda r: r["tokens_per_s"]) if synchronous else None
    answer = {"sites": sites, "wan": cluster.wan.to_dict(), "proposal": "synchronous",
              "best_synchronous": best_sync, "diloco": None, "round_options": [],
              "saving": None, "convergence_note": CONVERGENCE_NOTE}
    if not options:
        answer["why"] = ("no DiLoCo layout fits: the global batch must divide by the replica "
                         "count and a group's share of the cluster must hold the model")
        return answer
    fastest = max(r["tokens_per_s"] for r in options)
    good = [r for r in options if r["tokens_per_s"] >= (1 - ROUND_SLACK) * fastest]
    chosen = min(good, key=lambda r: (r["replicas"]["sync_every"],
                                      r["replicas"]["sync_fragments"],
                                      r["replicas"]["sync_overlap"], -r["tokens_per_s"]))
    same = [r for r in options if r["layout"] == chosen["layout"]
            and r["replicas"]["replicas"] == chosen["replicas"]["replicas"]]
    answer["diloco"] = _option_row(chosen)
    answer["round_options"] = [_option_row(r) for r in same]
    answer["saving"] = _saving(workload, cluster, chosen, energy)
    gain = chosen["tokens_per_s"] / best_sync["tokens_per_s"] if best_sync else None
    answer["speedup_over_synchronous"] = gain
    if gain is None:
        answer["proposal"] = "diloco"
        answer["why"] = "no synchronous layout fits; DiLoCo's groups do"
    elif gain >= DILOCO_MIN_GAIN:
        answer["proposal"] = "diloco"
        answer["why"] = (f"the wide-area link dominates synchronous training: DiLoCo is "
                         f"{gain:.2f} x as fast as the best synchronous layout")
    else:
        answer["why"] = (f"synchronous training loses little to the wide-area link: DiLoCo "
                         f"would be {gain:.2f} x as fast, under the {DILOCO_MIN_GAIN:.2f} x "
                         "that would pay for changing the optimisation")
    return answer


def _saving(workload: Workload, cluster: Cluster, chosen: dict, energy: dict | None) -> dict:
    """Wide-area bytes and seconds per step: synchronous dp over the same ranks vs DiLoCo."""
    replicas = chosen["replicas"]["replicas"]
    inner = layout_from_json(chosen["layout"])
    folds = [dataclasses.replace(inner, dp=inner.dp * replicas, zero=zero)
             for zero in ((0, 1) if inner.pp > 1 else (0, 1, 2, 3))]
    priced = [(r, lay) for lay, r in price_layouts(workload, cluster, folds, energy)]
    sync, folded = min(priced, key=lambda p: (not p[0]["fits"], p[0]["step_time_s"]))
    sync_bytes = dp_bus_bytes(workload, folded)
    return {"synchronous_layout": sync["layout"],
            "bytes_per_step_synchronous_dp": sync_bytes,
            "bytes_per_step_diloco": chosen["replica_comm_bytes"],
            "bytes_ratio": sync_bytes / chosen["replica_comm_bytes"],
            "comm_s_per_step_synchronous_dp": sync["breakdown"]["dp_comm_total_s"],
            "exposed_s_per_step_synchronous_dp": sync["breakdown"]["dp_comm_exposed_s"],
            "comm_s_per_step_diloco": chosen["replica_comm_s"],
            "step_s_synchronous_dp": sync["step_time_s"],
            "step_s_diloco": chosen["step_time_s"],
            "synchronous_dp_fits": sync["fits"]}


def format_site_plan(section: dict) -> str:
    """``plan``'s lines about the sites: the DiLoCo options, the proposal and the saving."""
    wan = section["wan"]
    lines = [f"across {section['sites']} sites (wide-area link {wan['wan_gbps']:g} Gb/s per "
             f"site, {wan['wan_latency_ms']:g} ms):"]
    if section["diloco"] is None:
        return "\n".join(lines + [f"  {section['why']}"])
    d = section["diloco"]
    lines.append(f"  DiLoCo with dp{d['dp']} tp{d['tp']} pp{d['pp']} cp{d['cp']} z{d['zero']} "
                 f"{d['activation_checkpointing']} per group:")
    lines.append(f"  {'replicas':>8} {'H':>4} {'F':>2} {'tau':>3} {'step s':>7} {'tok/s':>10} "
                 f"{'MB/step':>9} {'MB/sync':>9} {'wan s/step':>10}")
    for r in section["round_options"]:
        lines.append(f"  {r['replicas']:>8} {r['sync_every']:>4} {r['sync_fragments']:>2} "
                     f"{r['sync_overlap']:>3} "
                     f"{r['step_time_s']:>7.3f} {r['tokens_per_s']:>10,.0f} "
                     f"{r['replica_comm_bytes'] / 1e6:>9,.1f} "
                     f"{r['replica_sync_bytes_max'] / 1e6:>9,.1f} "
                     f"{r['replica_comm_exposed_s']:>10.3g}")
    s = section["saving"]
    if section["proposal"] == "diloco":
        lines.append(f"proposal: DiLoCo, parallel.replicas = {d['replicas']}, "
                     f"parallel.sync_every = {d['sync_every']}, parallel.sync_fragments = "
                     f"{d['sync_fragments']}, parallel.sync_overlap = {d['sync_overlap']}: "
                     f"{section['why']}")
    else:
        lines.append(f"proposal: synchronous (the table above); {section['why']}")
    sync_mb = s["bytes_per_step_synchronous_dp"] / 1e6
    lines.append(f"  vs synchronous dp over the same ranks: {sync_mb:,.1f} "
                 f"-> {s['bytes_per_step_diloco'] / 1e6:,.1f} MB per rank per step on the "
                 f"wide-area link ({s['bytes_ratio']:,.0f} x less), comm "
                 f"{s['comm_s_per_step_synchronous_dp']:.3g} -> {s['comm_s_per_step_diloco']:.3g}"
                 f" s per step, step {s['step_s_synchronous_dp']:.3g} -> "
                 f"{s['step_s_diloco']:.3g} s")
    lines.append("  " + section["convergence_note"])
    return "\n".join(lines)
