"""Enumerate layouts for a workload on a cluster, keep those that fit, rank by tokens/s.

The space: tp over the powers of two that fit in a node and divide the heads; cp over divisors of
what is left that split the sequence into ``2 cp`` equal chunks (the runtime's check); pp over
divisors of what is left after both (at most the layer count); dp the rest; ep over divisors of
dp × tp that divide tp or are multiples of it, and divide the expert count (MoE only, experts
folded over tp); ZeRO 0-3, a pipelined layout's ZeRO-2 and ZeRO-3 variants priced only when
its ZeRO-1 variant does not fit (:func:`price_layouts`); with tp > 1 sequence parallelism on and
off (the same communication volume, less activation memory, but more, smaller kernels);
schedules 1f1b, interleaved-1f1b (2, 4 and 8 chunks), zb-h1 and zb-v with pipelining (gpipe
only matches 1f1b's bubble with more memory); micro-batch sizes 1, 2, 4, 8; activation
checkpointing none, selective, full — of these, only what the priced stack offers
(``RuntimeTraits.zero_stages``, ``context_parallel``, ``pp_schedules``). When nothing fits,
:func:`explain_nothing_fits` says what dominates memory and how many GPUs the smallest
feasible layout would need. When nothing fits, :func:`plan` also tries ``parallel.offload``
settings on one site (:mod:`meshtrain.planner.search.offload`; ``offload="always"`` tries
them beside the layouts that fit as well).
"""

from __future__ import annotations

import dataclasses
import itertools

from meshtrain.config import ConfigError
from meshtrain.config.layout import Layout
from meshtrain.config.layout_rules import (
    interleaving_fits,
    pipeline_stages_fit,
    tp_fits,
    valid_expert_degrees,
)
from meshtrain.planner.cost.estimate import estimate
from meshtrain.planner.cost.memory import GB, model_state_bytes
from meshtrain.planner.cost.offload import NO_OFFLOAD, Offload
from meshtrain.planner.cost.workload import (
    RuntimeTraits,
    Workload,
    context_parallel_fits,
    interleave_min_pp,
    layout_from_json,
)
from meshtrain.planner.hardware.profile import Cluster

MICRO_BATCH_SIZES = (1, 2, 4, 8)
CHECKPOINTING = ("none", "selective", "full")
VIRTUAL_STAGES = (2, 4, 8)
"""Chunks per rank tried for interleaved 1F1B."""
MAX_VIRTUAL_STAGES = 8
"""With equal layer counts per stage (``RuntimeTraits.uniform_pipeline_stages``): every chunk
count from 2 to this that divides a stage's layers (Megatron-LM's ``--num-layers-per-virtual-
pipeline-stage``)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(pp: int, n_layers: int, microbatches: int,
               traits: RuntimeTraits) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    options = [("1f1b", 1), ("zb-h1", 1)]
    if pipeline_stages_fit(2 * pp, n_layers):
        options.append(("zb-v", 1))
    if interleaving_fits(pp, microbatches):
        if traits.uniform_pipeline_stages:  # Megatron-LM: v divides the stage's layers, pp > 2
            per_stage = n_layers // pp
            chunks = [v for v in range(2, MAX_VIRTUAL_STAGES + 1) if per_stage % v == 0
                      ] if pp >= interleave_min_pp(traits) else []
        else:
            chunks = [v for v in VIRTUAL_STAGES if pipeline_stages_fit(v * pp, n_layers)]
        options += [("interleaved-1f1b", v) for v in chunks]
    return [(name, v) for name, v in options if name in traits.pp_schedules]


def enumerate_layouts(workload: Workload, cluster: Cluster, *,
                      micro_batch_sizes: tuple[int, ...] = MICRO_BATCH_SIZES,
                      checkpointing: tuple[str, ...] = CHECKPOINTING,
                      zero_stages: tuple[int, ...] = (0, 1, 2, 3),
                      cps: tuple[int, ...] | None = None) -> list[Layout]:
    """Every layout in the search space that the shapes allow on exactly ``cluster.gpus``
    (``cps``: only these context-parallel degrees; default every one that fits)."""
    model, gpus = workload.model, cluster.gpus
    layouts = []
    tps = [t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and gpus % t == 0
           and tp_fits(t, n_heads=model.n_heads, kv_heads=model.kv_heads,
                       ffn_dim=model.ffn_dim)]
    traits = workload.traits  # only what the priced runtime offers
    cps = cps if traits.context_parallel else (1,)
    zero_stages = tuple(z for z in zero_stages if z in traits.zero_stages)
    pipelined_zero = pipeline_base_zero(traits)
    checkpointing = tuple(c for c in checkpointing if c in traits.checkpointing)
    sp_options = (True, False) if traits.sequence_parallel else (False,)
    shapes = [(t, c) for t in tps for c in _divisors(gpus // t)
              if (cps is None or c in cps) and context_parallel_fits(workload, c, t, t > 1)]
    for tp, cp in shapes:
        for pp in _divisors(gpus // (tp * cp)):
            if (not pipeline_stages_fit(pp, model.n_layers)
                    or (traits.uniform_pipeline_stages and model.n_layers % pp)):
                continue
            dp = gpus // (tp * cp * pp)
            eps = valid_expert_degrees(dp, tp, model.moe_experts)  # [1] for a dense model
            for b in micro_batch_sizes:
                if workload.global_batch % (dp * b):
                    continue
                m = workload.global_batch // (dp * b)
                if pp > 1 and m < pp:
                    continue
                for ep in eps:
                    for zero in zero_stages:
                        if (pp > 1 and zero > pipelined_zero) or (dp == 1 and zero > 0):
                            continue
                        for schedule, v in _schedules(pp, model.n_layers, m, traits):
                            for sp, ckpt in itertools.product(
                                    sp_options if tp > 1 else (False,), checkpointing):
                                layouts.append(Layout(
                                    dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero,
                                    sequence_parallel=sp, pp_schedule=schedule,
                                    virtual_stages=v, microbatches=m,
                                    activation_checkpointing=ckpt))
    return layouts


def pipeline_base_zero(traits: RuntimeTraits) -> int:
    """The ZeRO stage a pipelined layout is searched at beside ZeRO-0: the least sharding the
    runtime offers (1 for the Megatron-style stacks and meshtrain; 2 for ``llama3-2024``,
    whose FSDP shards gradients with the optimizer state and has no ZeRO-1)."""
    return min((z for z in traits.zero_stages if z >= 1), default=1)


def price_layouts(workload: Workload, cluster: Cluster, layouts: list[Layout],
                  energy: dict | None = None,
                  offload: Offload = NO_OFFLOAD) -> list[tuple[Layout, dict]]:
    """``(layout, closed-form estimate)`` of every layout in ``layouts``, plus the sharded
    variants of the pipelined ones that need them.

    A pipelined layout at ZeRO-1 that does not fit is priced again at ZeRO-2 (gradients
    sharded over dp), and if that does not fit either, at ZeRO-3 (weights too), where the
    stack offers those stages: the least sharding that fits (a stack without ZeRO-1 searches
    pipelines at its least sharding, :func:`pipeline_base_zero`, and grows from there).
    Under a pipeline both stages reduce-scatter every micro-batch (ZeRO-3 gathers the weights
    every micro-batch too), the traffic that makes Megatron-LM and DeepSpeed pair pipelines
    with ZeRO-1 only; so a variant is priced only where the sharding is what makes the layout
    fit, which also keeps the search near the size of the unsharded one. A variant whose
    lower bound (the optimizer shard and activations as at ZeRO-1, plus the whole weights at
    ZeRO-2) is already over the memory limit is skipped unpriced. Every layout is priced with
    ``offload`` (the ``parallel.offload*`` settings; a variant whose ZeRO stage cannot run them
    is skipped)."""
    priced = []
    stages = workload.traits.zero_stages
    base = pipeline_base_zero(workload.traits)
    for layout in layouts:
        result = estimate(workload, layout, cluster, energy, use_simulator=False,
                          offload=offload)
        priced.append((layout, result))
        if result["fits"] or layout.pp == 1 or layout.zero != base or layout.dp == 1:
            continue
        limit = result["memory_limit_gb"] * GB
        for zero in (2, 3):
            if zero <= base or zero not in stages or any(
                    r["optim_bytes"] + r["activation_bytes"] + (r["param_bytes"] if zero == 2
                                                               else 0) > limit
                    for r in result["per_rank"]):
                continue
            sharded = dataclasses.replace(layout, zero=zero)
            if offload.active and zero != 3 and (offload.params or offload.overlap):
                continue  # what needs ZeRO-3 (check_offload)
            priced.append((sharded, estimate(workload, sharded, cluster, energy,
                                             use_simulator=False, offload=offload)))
            priced[-1][1]["sharded_from_zero"] = base  # why() says so
            if priced[-1][1]["fits"]:
                break
    return priced


def _speed(result: dict) -> tuple[float, float]:
    """Sort key, fastest first: tokens/s, then (among layouts held at the profile's MFU cap)
    the step time the cost model gave before the cap."""
    return (-result["tokens_per_s"],
            result["step_time_s"] - result["breakdown"].get("mfu_cap_s", 0.0))


def why(result: dict) -> str:
    """One line on what bounds a candidate."""
    step = result["step_time_s"]
    parts = sorted(((v / step, k.removesuffix("_s")) for k, v in result["breakdown"].items()
                    if k not in ("compute_s", "dp_comm_total_s") and v > 0.01 * step),
                   reverse=True)
    compute = result["breakdown"]["compute_s"] / step
    text = f"compute {compute:.0%}"
    if parts:
        text += "; " + ", ".join(f"{name} {share:.0%}" for share, name in parts[:3])
    headroom = result["memory_limit_gb"] - result["memory_gb_per_gpu"]
    text = f"{result['bound']}-bound ({text}); {headroom:.0f} GB memory headroom"
    lay = result["layout"]
    if "sharded_from_zero" in result and not result.get("offload"):  # price_layouts' variant
        text += (f"; ZeRO-{lay['zero']} as this pipeline does not fit at "
                 f"ZeRO-{result['sharded_from_zero']}")
    if result.get("offload"):
        from meshtrain.planner.search.offload import cost_text

        text += "; " + cost_text(result)
    return text


def candidate_row(result: dict) -> dict:
    """The flat candidate record ``plan --json`` prints."""
    lay = result["layout"]
    row = {k: lay[k] for k in ("dp", "tp", "pp", "cp", "ep", "zero", "sequence_parallel")}
    row.update(schedule=lay["schedule"], virtual_stages=lay["virtual_stages"],
               microbatches=lay["microbatches"], micro_batch_size=result["micro_batch_size"],
               activation_checkpointing=lay["activation_checkpointing"])
    for key in ("memory_gb_per_gpu", "step_time_s", "tokens_per_s", "mfu",
                "model_tflops_per_gpu", "hardware_tflops_per_gpu", "bubble_fraction",
                "kwh_per_1b_tokens", "cost_per_1b_tokens", "co2_kg_per_1b_tokens", "bound"):
        row[key] = result[key]
    cost = result.get("offload")
    row.update(offload=cost["kind"] if cost else "none",
               offload_device=cost["device"] if cost else None,
               offload_overlap=cost["overlap"] if cost else False,
               offload_s=result["breakdown"].get("offload_s", 0.0),
               host_gb_per_node=cost["host_gb_per_node"] if cost else None,
               nvme_gb_per_node=cost["nvme_gb_per_node"] if cost else None)
    row["why"] = why(result)
    return row


@dataclasses.dataclass
class PlanResult:
    """Ranked feasible candidates, or (when empty) the explanation of why nothing fits."""

    candidates: list[dict]
    searched: int
    feasible: int
    """Searched layouts that fit in memory as the closed forms price them (the same count
    whatever ``top`` is)."""
    nothing_fits: str | None = None
    offload: str | None = None
    """What offload the search tried and what fit with it (None when it tried none)."""
    resimulated_not_fitting: int = 0
    """Front runners (the first ``3 × top`` that fit) that no longer fit once re-priced with the
    schedule simulator's in-flight micro-batches; counted in :attr:`feasible`, not listed."""
    priced: list[dict] = dataclasses.field(default_factory=list, repr=False)
    """Every searched layout's closed-form estimate (fitting or not), for callers that compare
    the ranking with the rest of the search; not part of the JSON form."""

    def to_dict(self) -> dict:
        """JSON form (without :attr:`priced`)."""
        out = dataclasses.asdict(dataclasses.replace(self, priced=[]))
        out.pop("priced")
        return out


def plan(workload: Workload, cluster: Cluster, top: int = 10,
         energy: dict | None = None, explain: bool = True,
         offload: str = "auto") -> PlanResult:
    """Search, prune what does not fit, rank by predicted tokens/s (``explain``: say why
    nothing fits, searching larger clusters; else leave ``nothing_fits`` short). ``offload``:
    ``auto`` searches offload settings when nothing fits without them, ``always`` beside every
    layout, ``never`` not (:mod:`meshtrain.planner.search.offload`)."""
    from meshtrain.planner.search.offload import (
        offload_note,
        price_offloaded,
        why_offload_does_not_fit,
    )

    layouts = enumerate_layouts(workload, cluster)
    if not layouts:
        raise ConfigError(f"no layout of {cluster.gpus} GPUs divides this model and batch "
                          f"(global batch {workload.global_batch}); try a global batch that is "
                          f"a multiple of the GPU count.")
    priced = price_layouts(workload, cluster, layouts, energy)
    results = [result for _, result in priced]
    without = sum(1 for r in results if r["fits"])
    offloaded, note = [], None
    searching = cluster.wan is None and (offload == "always" or (offload == "auto"
                                                                 and not without))
    if searching:  # one site only: across sites DiLoCo prices the inner layouts as they are
        offloaded = price_offloaded(workload, cluster, priced, energy)
        note = offload_note(len(offloaded), sum(1 for *_, r in offloaded if r["fits"]),
                            len(results), offload)
    feasible = sorted((r for r in results + [r for *_, r in offloaded] if r["fits"]),
                      key=_speed)
    # Re-price the front runners with the schedule simulator (closed forms ranked them); one
    # that no longer fits (the simulator's in-flight micro-batches) is not counted either.
    front = []
    for r in feasible[:3 * top]:
        front.append(estimate(workload, layout_from_json(r["layout"]), cluster, energy,
                              offload=Offload.from_json(r["offload"])))
        if "sharded_from_zero" in r:  # a price_layouts variant stays one
            front[-1]["sharded_from_zero"] = r["sharded_from_zero"]
    count = len(feasible)
    dropped = sum(1 for r in front if not r["fits"])
    feasible = sorted((r for r in front if r["fits"]), key=_speed)
    rows = [candidate_row(r) for r in feasible[:top]]
    message = None
    if not feasible:
        message = (explain_nothing_fits(workload, cluster, results) if explain
                   else f"nothing fits on {cluster.gpus} GPUs")
        if searching:
            message += " " + why_offload_does_not_fit(offloaded)
    searched = len(results) + len(offloaded)
    return PlanResult(rows, searched, count, message, note, dropped,
                      results + [r for *_, r in offloaded])


def explain_nothing_fits(workload: Workload, cluster: Cluster, results: list[dict]) -> str:
    """Why no layout fits, and how many GPUs the leanest layout would need."""
    leanest = min(results, key=lambda r: r["memory_gb_per_gpu"])
    worst = max(leanest["per_rank"], key=lambda r: r["total_bytes"])
    states = (worst["param_bytes"] + worst["grad_bytes"] + worst["optim_bytes"]) / GB
    acts = worst["activation_bytes"] / GB
    limit = leanest["memory_limit_gb"]
    lay = leanest["layout"]
    params = leanest["params"]
    floor = sum(model_state_bytes(params, 3, cluster.gpus, workload.precision,
                                  workload.traits.grad_reduce_bytes)) / GB
    text = (f"nothing fits: {len(results)} layouts searched on {cluster.gpus} x "
            f"{cluster.profile.name} ({limit:.0f} GB usable each). The leanest "
            f"(dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} cp={lay['cp']} zero={lay['zero']}, "
            f"{lay['activation_checkpointing']} checkpointing) needs "
            f"{leanest['memory_gb_per_gpu']:.0f} GB on pipeline stage {worst['stage']}: "
            f"{states:.0f} GB of model states and {acts:.0f} GB of activations. Model states "
            f"alone need 16 bytes x {params / 1e9:.0f}B parameters = "
            f"{16 * params / GB:.0f} GB, at least {floor:.0f} GB per GPU even fully sharded "
            f"over {cluster.gpus} GPUs.")
    needed = smallest_feasible_gpus(workload, cluster)
    if needed:
        gpus, best = needed
        bl = best["layout"]
        text += (f" It would fit on {gpus} GPUs (e.g. dp={bl['dp']} tp={bl['tp']} pp={bl['pp']}"
                 f" cp={bl['cp']} zero={bl['zero']}, {bl['activation_checkpointing']} "
                 f"checkpointing, "
                 f"{best['memory_gb_per_gpu']:.0f} GB per GPU).")
    else:
        text += " No cluster up to 64 times this size fits it with this global batch."
    return text


def smallest_feasible_gpus(workload: Workload, cluster: Cluster,
                           max_factor: int = 64) -> tuple[int, dict] | None:
    """The fewest GPUs (doubling) on which a memory-lean layout fits, and that layout."""
    gpus = cluster.gpus * 2
    while gpus <= cluster.gpus * max_factor:
        bigger = Cluster(cluster.profile, gpus, cluster.gpus_per_node)
        layouts = enumerate_layouts(workload, bigger, micro_batch_sizes=(1,),
                                    checkpointing=("full",), zero_stages=(1, 3))
        layouts = [lay for lay in layouts if lay.pp_schedule == "1f1b"]
        fits = [r for _, r in price_layouts(workload, bigger, layouts) if r["fits"]]
        if fits:
            return gpus, max(fits, key=lambda r: r["tokens_per_s"])
        gpus *= 2
    return None
