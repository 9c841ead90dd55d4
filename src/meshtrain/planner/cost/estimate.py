"""One layout priced end to end: memory per rank, step time and its breakdown, FLOP/s, energy.

Step time = the pipelined forward/backward of the slowest stage (``m`` micro-batches plus the
schedule's bubble) + the exposed part of data-parallel communication + the optimizer update
(``RuntimeTraits.optimizer_bytes_per_param`` through memory; with ``parallel.offload`` instead
the host's update and the PCIe and NVMe transfers, ``offload_s``,
:mod:`meshtrain.planner.cost.offload`) + a few latency-bound all-reduces
per axis (loss and gradient norm, ``STEP_SYNCS_PER_AXIS``), and never shorter than the profile's
``max_mfu`` allows (the best published MFU on that accelerator; the difference is
``mfu_cap_s``).

Data-parallel communication per step (bus bytes from :mod:`meshtrain.parallel.comm`), gradients
on the wire at ``RuntimeTraits.grad_reduce_bytes`` per element, parameters in the training dtype:
ZeRO-0 one all-reduce; ZeRO-1 a reduce-scatter and a parameter all-gather; ZeRO-2 a reduce-scatter
per micro-batch (meshtrain keeps no full gradient buffer) and an all-gather; ZeRO-3 per micro-batch
and block (each collective paying its latency) an all-gather in forward, one in backward and a
reduce-scatter. Where the runtime overlaps them, only what outlasts the compute they hide behind
is exposed, bucket by bucket (:mod:`meshtrain.planner.cost.overlap`: ZeRO 0-1 behind the last
micro-batch's backward, ZeRO-2 behind every micro-batch's, ZeRO-3 gathers prefetched behind the
previous unit's compute) — unless the profile says communication cannot run beside compute
(CPUs, ``comm_overlaps_compute``); the ZeRO-1/2 parameter all-gather after the update is
exposed. The estimate's ``overlap`` table gives, per axis (dp, tp, cp, ep, pp), ``total_s``,
``overlapped_s`` and ``exposed_s`` per step. With context parallelism the
reduction (and ZeRO's sharding) spans the ``dp × cp`` ranks, expert parameters' the
``dp × tp / ep × cp`` (experts are folded over tp, :mod:`meshtrain.planner.cost.expert_parallel`);
without it, ``dp`` and ``dp × tp / ep``. The cp K/V all-gathers and reduce-scatters
(:mod:`meshtrain.planner.cost.context_parallel`) sit in the micro-batch's forward and backward, not
overlapped; ``cp_comm_bytes`` is their bus bytes per rank and step (the runtime's
``comm_bytes.cp``), ``ep_comm_bytes`` the expert all-to-alls' of a rank of the slowest stage (the
runtime's ``comm_bytes.ep``, dropless).

Model FLOPs are :func:`meshtrain.model.init.flops_per_token` × tokens (the MFU basis); hardware
FLOPs add what activation checkpointing recomputes.

An MoE model balanced on the global batch (``model.moe_balance_scope = "global-batch"``) adds its
count all-reduces over dp × cp to the dp step syncs and, with several micro-batches or pipeline
stages, its routing pre-pass (a forward-only pass of every micro-batch) as
``balance_prepass_s``; ``balance_comm_bytes`` is what those all-reduces add to ``comm_bytes.dp``
(:mod:`meshtrain.planner.cost.expert_parallel`).
"""

from __future__ import annotations

import math

from meshtrain.config.layout import Layout
from meshtrain.config.model_size import count_parameters, flops_per_token
from meshtrain.planner.cost.context_parallel import forward_share, reduction_group, step_bus_bytes
from meshtrain.planner.cost.expert_parallel import (
    balance_prepass,
    balance_reductions,
    balance_step_bus_bytes,
    ep_step_bus_bytes,
    expert_reduction_size,
    expert_reduction_stride,
)
from meshtrain.planner.cost.memory import GB, layer_params, rank_memory, stage_params
from meshtrain.planner.cost.offload import (
    NO_OFFLOAD,
    Offload,
    check_offload,
    offload_cost,
    offloaded_memory,
    shard_params,
)
from meshtrain.planner.cost.overlap import (
    bucketed_exposed,
    contended,
    overlap_entry,
    prefetched_exposed,
    zero3_exposed,
)
from meshtrain.planner.cost.pipeline import interleaved_peak_layers, pipeline_estimate
from meshtrain.planner.cost.timing import BlockCost, block_cost, embedding_tp_cost, head_cost
from meshtrain.planner.cost.workload import (
    Workload,
    check_fp8,
    check_layout,
    chunk_layer_counts,
    layout_to_json,
    stack_split,
    stage_layers,
)
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.hardware.stack_efficiency import kernel_efficiency

STEP_SYNCS_PER_AXIS = 3
"""Small latency-bound all-reduces per step on every axis of size > 1: the gradient norm's
partial sums, and the loss (one over pp, one over dp; tp's grad-norm and replicated-gradient
reductions). Seen in :meth:`meshtrain.training.trainer.Trainer.train_step`."""


ZERO3_MAX_UNITS_PER_BLOCK = 7
"""ZeRO-3 units one block splits into at most when it exceeds a bucket: its single projections
(q, k, v, o; the MLP's up, gate and down), :func:`meshtrain.parallel.data._zero3_units`."""


def _stage_cost(workload: Workload, layout: Layout, cluster: Cluster, layers: list[int],
                last: bool, cache: dict[int, BlockCost], first: bool = False) -> BlockCost:
    total = BlockCost()
    if first:
        total.tp_comm += embedding_tp_cost(workload, layout, cluster)
    model = workload.model
    moe = model.moe_layer_count(layers)
    for key, count in ((0, len(layers) - moe), (1, moe)):
        if count:
            if key not in cache:
                layer = next(i for i in layers if model.is_moe_layer(i) == bool(key))
                cache[key] = block_cost(workload, layout, cluster, layer)
            total.add(cache[key], count)
    if last:
        total.add(head_cost(workload, layout, cluster))
    return total


_MODEL_TOTALS: dict[str, tuple[int, int, float]] = {}


def _model_totals(workload: Workload) -> tuple[int, int, float]:
    """(total params, active params, model FLOPs per token), cached per shape."""
    key = repr((workload.model, workload.seq_len))
    if key not in _MODEL_TOTALS:
        counts = count_parameters(workload.model)
        _MODEL_TOTALS[key] = (counts["total"], counts["active"],
                              flops_per_token(workload.model, workload.seq_len))
    return _MODEL_TOTALS[key]


def _fill_drain_speedup(layout: Layout, cluster: Cluster) -> float:
    """Time factor of the pipeline's fill and drain on a shared CPU. The bubble is made of
    stretches where only some stages work (1, 2, ..., p-1 of p: half on average); ranks idle in
    a receive leave the busy ones a larger share of the cores, so those stretches run at the
    per-process rate of half the processes (one process alone for pp2), not of all. 1 on GPUs,
    whose rates do not depend on how many ranks compute."""
    if layout.pp == 1:
        return 1.0
    everyone = cluster.process_rates()[0]
    half = cluster.profile.per_process(max(layout.world_size // 2, 1),
                                       cluster.threads_per_process)[0]
    return everyone / half if half > 0 else 1.0


def _dp_time(workload: Workload, layout: Layout, cluster: Cluster, dense: float, expert: float,
             backward: float, forward: float, blocks: int = 1,
             root: float = 0.0) -> tuple[float, float]:
    """(total, exposed) seconds of data-parallel communication per step on one rank, overlapped
    as the runtime schedules it (:mod:`meshtrain.planner.cost.overlap`); ``backward`` and
    ``forward`` are one micro-batch's, ``blocks`` the stage's blocks (ZeRO-3's units);
    ``root``: dense parameters ZeRO-3 gathers once and reduce-scatters once per step instead
    of per micro-batch (a pipeline stage's embedding and head), both exposed."""
    lay, traits = layout, workload.traits
    size, stride = reduction_group(lay)
    groups = [(dense, size, stride)]
    total = exposed = 0.0
    if expert:  # with cp, the cp ranks (tp apart) set how many share a node: approximate
        sharded = traits.moe_sequence_sharded
        groups.append((expert, expert_reduction_size(lay, sharded),
                       expert_reduction_stride(lay, sharded)))
    m = lay.microbatches
    overlap = traits.overlap_dp and cluster.profile.comm_overlaps_compute
    contention = cluster.profile.overlap_contention
    if root and size > 1:  # gathered when the step starts, reduced when it ends
        held = (cluster.collective_time("all_gather", root * workload.act_bytes, size, stride,
                                        "dp")
                + cluster.collective_time("reduce_scatter", root * traits.grad_reduce_bytes,
                                          size, stride, "dp"))
        total, exposed = held, held
        groups[0] = (dense - root, size, stride)
    for params, size, stride in groups:
        if size <= 1 or params <= 0:
            continue
        grads = params * traits.grad_reduce_bytes
        weights = params * workload.act_bytes
        buckets = max(math.ceil(weights / traits.dp_bucket_bytes), 1)

        def t(op, nbytes, size=size, stride=stride):
            return cluster.collective_time(op, nbytes, size, stride, "dp")

        def reduce(op, nbytes, size=size, stride=stride):  # ZeRO 0-1: maybe shared memory
            return cluster.dp_gradient_reduce_time(op, nbytes, size, stride,
                                                   traits.grad_reduce_bytes == 4)

        tail_exposed = None
        if lay.zero in (0, 1):  # reduced during the last micro-batch's backward only (a
            # pipeline under Megatron-LM's torch DDP: during every micro-batch's)
            one = reduce("all_reduce" if lay.zero == 0 else "reduce_scatter", grads)
            times = (m if lay.zero == 0 and lay.pp > 1
                     and traits.pipeline_reduces_every_microbatch else 1)
            hidden = times * one
            tail = t("all_gather", weights) if lay.zero == 1 else 0.0
            hidden_exposed = times * bucketed_exposed(one, backward, buckets)
        elif lay.zero == 2:  # reduce-scattered during every micro-batch's backward
            one = t("reduce_scatter", grads)
            hidden, tail = m * one, t("all_gather", weights)
            hidden_exposed = m * bucketed_exposed(one, backward, buckets)
        else:  # gathered and reduce-scattered unit by unit, every micro-batch
            per_block = (min(math.ceil(buckets / max(blocks, 1)), ZERO3_MAX_UNITS_PER_BLOCK)
                         if traits.zero3_split_blocks else 1)
            units = max(blocks, 1) * per_block
            gather = units * t("all_gather", weights / units)
            scatter = units * t("reduce_scatter", grads / units)
            hidden, tail = m * (2 * gather + scatter), 0.0
            hidden_exposed = m * zero3_exposed(gather, scatter, forward, backward, units)
        if tail and overlap and traits.param_gather_overlap:  # behind the next forward
            tail_exposed = contended(prefetched_exposed(tail, forward, buckets), tail,
                                     contention)
        total += hidden + tail
        exposed += (tail if tail_exposed is None else tail_exposed) + (
            contended(hidden_exposed, hidden, contention) if overlap else hidden)
    return total, exposed


def _tied_embedding_time(workload: Workload, layout: Layout, cluster: Cluster,
                         zero_share: int) -> float:
    """Seconds per step of a tied embedding's gradient all-reduce between the first and the
    last pipeline rank (its tp piece, its ZeRO shard at stages 1-2), after backward."""
    model, lay = workload.model, layout
    if not model.tie_embeddings or lay.pp <= 1:
        return 0.0
    grads = model.vocab_size * model.dim / lay.tp / zero_share * workload.traits.grad_reduce_bytes
    return cluster.collective_time("all_reduce", grads, 2, (lay.pp - 1) * lay.tp * lay.cp * lay.dp,
                                   "pp")


def estimate(workload: Workload, layout: Layout, cluster: Cluster,
             energy: dict | None = None, use_simulator: bool = True,
             offload: Offload = NO_OFFLOAD, replicas: int = 1) -> dict:
    """Price ``layout`` for ``workload`` on ``cluster``; a JSON-ready dict (see docs/planner.md).

    ``energy``: ``pue``, ``price_per_kwh``, ``carbon_g_per_kwh`` (defaults 1.2, 0.10, 400).
    ``use_simulator``: time the pipeline with the runtime's schedule simulator (else closed forms).
    ``offload``: the ``parallel.offload*`` settings (:mod:`meshtrain.planner.cost.offload`);
    ``replicas``: DiLoCo replica groups the layout is the inner layout of (their outer state is
    offloaded too, and they share nodes).
    """
    check_layout(workload, layout)
    check_fp8(workload, cluster.profile.name, cluster.profile.fp8_rate)
    check_offload(workload, layout, offload, replicas)
    model, lay = workload.model, layout
    placement = stage_layers(model, stack_split(workload, lay))
    cache: dict[int, BlockCost] = {}
    costs = [_stage_cost(workload, lay, cluster, layers, r == lay.pp - 1, cache, r == 0)
             for r, layers in enumerate(placement)]
    slowest = max(range(lay.pp), key=lambda r: costs[r].compute + costs[r].tp_comm
                  + costs[r].ep_comm + costs[r].cp_comm)
    c = costs[slowest]

    b = lay.micro_batch_size(workload.global_batch)
    boundary = b * workload.seq_len / lay.cp * model.dim * workload.act_bytes
    # Scatter/gather (Narayanan et al. 2021, 4.1): each tp rank sends 1/t of the replicated
    # boundary and the receiver all-gathers it over NVLink, once per received activation or
    # gradient. Under sequence parallelism the boundary is already split: nothing to gather.
    gather = 0.0
    if lay.sequence_parallel:
        boundary /= lay.tp
    elif workload.traits.pp_scatter_gather and lay.tp > 1:
        gather = cluster.collective_time("all_gather", boundary, lay.tp, 1, "tp")
        boundary /= lay.tp
    sends = 2 * lay.chunks_per_rank if lay.pp > 1 else 0
    one_send = cluster.p2p_time(boundary, lay.tp * lay.cp * lay.dp, lay.pp) + gather
    pp_total = sends * one_send
    if (workload.traits.pp_comm_overlap and lay.pp_schedule == "interleaved-1f1b"
            and cluster.profile.comm_overlaps_compute):
        # Posted a chunk ahead (overlap_p2p_comm): exposed only beyond one chunk's forward.
        one_send = contended(max(one_send - c.forward / lay.chunks_per_rank, 0.0), one_send,
                             cluster.profile.overlap_contention)
    pp_comm = sends * one_send

    cp_f = c.cp_comm * forward_share(lay)
    comm_f = (c.tp_comm + c.ep_comm) / 3 + pp_comm / 2 + cp_f
    comm_b = (c.tp_comm + c.ep_comm) * 2 / 3 + pp_comm / 2 + c.cp_comm - cp_f
    stage_times = []  # [F, B-input, B-weight] of one micro-batch through each rank's layers
    for cost in costs:
        share = cost.cp_comm * forward_share(lay)
        spread = cost.tp_comm + cost.ep_comm
        stage_times.append([cost.forward + spread / 3 + pp_comm / 2 + share,
                            cost.backward_input + cost.recompute + spread * 2 / 3 + pp_comm / 2
                            + cost.cp_comm - share, cost.backward_weight])
    f = c.forward + comm_f
    bi = c.backward_input + c.recompute + comm_b
    w = c.backward_weight
    pipe = pipeline_estimate(lay.pp_schedule, lay.pp, lay.microbatches, lay.virtual_stages, f,
                             bi, w, use_simulator, workload.traits.pp_early_grad_sends)
    unit = f + bi + w
    pipelined = pipe.makespan_units * unit if lay.pp > 1 else lay.microbatches * unit
    bubble = (pipelined - lay.microbatches * unit) * _fill_drain_speedup(lay, cluster)
    pipelined = lay.microbatches * unit + bubble

    params_by_stage = [stage_params(model, layers, lay, r == 0, r == lay.pp - 1)
                       for r, layers in enumerate(placement)]
    sp = params_by_stage[slowest]
    # ZeRO-3 under a pipeline holds the stage's root (embedding, head) for the whole step.
    root = (sp.dense - sum(layer_params(model, layer, lay.tp, lay.ep)[0]
                           for layer in placement[slowest])
            if lay.zero == 3 and lay.pp > 1 else 0.0)
    dp_total, dp_exposed = _dp_time(workload, lay, cluster, sp.dense, sp.expert,
                                    c.backward_input + c.backward_weight + c.recompute, c.forward,
                                    len(placement[slowest]), root)
    zero_share = reduction_group(lay)[0] if lay.zero >= 1 else 1
    expert_share = (expert_reduction_size(lay, workload.traits.moe_sequence_sharded)
                    if lay.zero >= 1 else 1)
    shard = sp.dense / zero_share + sp.expert / expert_share
    optimizer = (shard * workload.traits.optimizer_bytes_per_param
                 / (cluster.process_rates()[1] * 1e9))
    sync_by_axis = {axis: STEP_SYNCS_PER_AXIS * cluster.collective_time("all_reduce", 8, size,
                                                                         stride, axis)
                    for axis, (size, stride) in (("dp", reduction_group(lay)), ("tp", (lay.tp, 1)),
                                                 ("pp", (lay.pp, lay.tp * lay.cp * lay.dp)))}
    # MoE global-batch balance: its count all-reduces over dp × cp, and with several
    # micro-batches or stages its routing pre-pass, a forward-only pass of every micro-batch.
    dp_group = reduction_group(lay)
    sync_by_axis["dp"] += sum(cluster.collective_time("all_reduce", nbytes, *dp_group, "dp")
                              for nbytes in balance_reductions(workload, lay,
                                                               placement[slowest]))
    prepass = (lay.microbatches + lay.pp - 1) * f if balance_prepass(workload, lay) else 0.0
    syncs = sum(sync_by_axis.values())
    tied = _tied_embedding_time(workload, lay, cluster, zero_share)
    offloaded = None
    if offload.active:  # the update runs where the state lives (host AdamW, PCIe, NVMe)
        shards = [shard_params(p, lay) for p in params_by_stage]
        offloaded = offload_cost(workload, lay, cluster, offload, max(shards), f, replicas)
        optimizer = 0.0
    offload_s = offloaded["exposed_s"] if offloaded else 0.0
    step = pipelined + dp_exposed + optimizer + syncs + tied + prepass + offload_s
    total_params, active_params, per_token = _model_totals(workload)
    model_flops = per_token * workload.tokens_per_step
    peak = cluster.profile.peak_tflops * 1e12
    # Never promise more than the best published MFU on this accelerator (HardwareProfile.
    # max_mfu): a faster step is the cost model's optimism, charged as lost efficiency. The cap
    # is a bf16 figure: FP8 linear layers are not held to it.
    cap = 0.0 if workload.traits.fp8_linear else cluster.profile.max_mfu
    floor = model_flops / (lay.world_size * peak * cap) if cap > 0 else 0.0
    mfu_cap = max(floor - step, 0.0)
    step += mfu_cap

    inflight = list(pipe.peak_inflight)
    if lay.pp_schedule == "interleaved-1f1b" and lay.virtual_stages > 1 and lay.pp > 1:
        # Chunks may differ in size (e.g. a first chunk holding only the embedding): count the
        # layers in flight by walking each rank's order of work over its chunks.
        chunks = chunk_layer_counts(model, stack_split(workload, lay))
        inflight = [interleaved_peak_layers(lay.pp, lay.microbatches, lay.virtual_stages, r,
                                            tuple(chunks[r])) / sum(chunks[r])
                    if len(set(chunks[r])) > 1 else x for r, x in enumerate(inflight)]
    memory = [rank_memory(workload, lay, r, layers, inflight[r],
                          params=params_by_stage[r],
                          reserve_fraction=cluster.profile.allocator_reserve)
              for r, layers in enumerate(placement)]
    if offload.active:
        memory = [offloaded_memory(mem, shard, workload, lay, offload, cluster.profile)
                  for mem, shard in zip(memory, shards, strict=True)]
    tokens = workload.tokens_per_step
    gpus = lay.world_size
    recomputed = sum(costs[r].recompute_flops for r in range(lay.pp))
    hardware_flops = model_flops + recomputed * lay.tp * lay.cp * lay.dp * lay.microbatches
    if prepass:  # the pre-pass's forward: a third of the model FLOPs
        hardware_flops += model_flops / 3
    m = lay.microbatches
    breakdown = {
        "compute_s": m * (c.forward + c.backward_input + c.backward_weight),
        "recompute_s": m * c.recompute,
        "tp_comm_s": m * c.tp_comm,
        "ep_comm_s": m * c.ep_comm,
        "cp_comm_s": m * c.cp_comm,
        "pp_comm_s": m * pp_comm + tied,
        "bubble_s": bubble,
        "dp_comm_exposed_s": dp_exposed,
        "dp_comm_total_s": dp_total,
        "optimizer_s": optimizer,
        "offload_s": offload_s,
        "step_sync_s": syncs,
        "balance_prepass_s": prepass,
        "mfu_cap_s": mfu_cap,
    }
    # What each axis's communication hides behind (meshtrain.planner.cost.overlap): dp's
    # reductions and gathers; tp, cp and pp only in stacks that pipeline them with compute.
    overlap = {"dp": overlap_entry(dp_total, dp_exposed),
               "tp": overlap_entry(m * (c.tp_comm + c.tp_hidden), m * c.tp_comm),
               "cp": overlap_entry(m * (c.cp_comm + c.cp_hidden), m * c.cp_comm),
               "ep": overlap_entry(m * (c.ep_comm + c.ep_hidden), m * c.ep_comm),
               "pp": overlap_entry(m * pp_total + tied, m * pp_comm + tied)}
    result = {
        "params": total_params,
        "active_params": active_params,
        "gpus": gpus,
        "layout": layout_to_json(lay),
        "micro_batch_size": b,
        "tokens_per_step": tokens,
        "cp_comm_bytes": int(step_bus_bytes(workload, lay, len(placement[slowest]))),
        "ep_comm_bytes": int(ep_step_bus_bytes(workload, lay, placement[slowest])),
        "balance_comm_bytes": balance_step_bus_bytes(workload, lay, placement[slowest]),
        "per_rank": [mem.to_dict() for mem in memory],
        "memory_gb_per_gpu": max(mem.total_bytes for mem in memory) / GB,
        "memory_limit_gb": cluster.profile.memory_gb - cluster.profile.reserved_gb,
        "step_time_s": step,
        "tokens_per_s": tokens / step,
        "model_tflops_per_gpu": model_flops / step / gpus / 1e12,
        "hardware_tflops_per_gpu": hardware_flops / step / gpus / 1e12,
        "mfu": model_flops / step / gpus / peak,
        "fp8_linear": workload.traits.fp8_linear,
        "fp8_params": workload.traits.fp8_params,
        "hfu": hardware_flops / step / gpus / peak,
        "bubble_fraction": bubble / step if step else 0.0,
        "pipeline_model": pipe.source,
        "breakdown": breakdown,
        "step_sync_by_axis_s": sync_by_axis,
        "overlap": overlap,
        "overlap_contention": (cluster.profile.overlap_contention
                               if cluster.profile.comm_overlaps_compute else 0.0),
        "bound": _bound(breakdown),
        "stage_times_s": stage_times,
        "kernel_efficiency": kernel_efficiency(workload.traits.kernel_efficiency,
                                               cluster.profile).to_dict(cluster.profile),
    }
    result["offload"] = offloaded
    result["fits"] = (result["memory_gb_per_gpu"] <= result["memory_limit_gb"]
                      and (offloaded is None or offloaded["fits"]))
    result.update(energy_per_token(result, cluster, energy or {}))
    return result


def _bound(breakdown: dict) -> str:
    """The largest non-compute cost, or ``compute`` when compute is over 80 % of the step."""
    total = sum(v for k, v in breakdown.items() if k != "dp_comm_total_s")
    if breakdown["compute_s"] >= 0.8 * total:
        return "compute"
    others = {k: v for k, v in breakdown.items() if k not in ("compute_s", "dp_comm_total_s")}
    return max(others, key=others.get).removesuffix("_s")


def energy_per_token(result: dict, cluster: Cluster, options: dict) -> dict:
    """kWh, cost and CO2 per 10^9 tokens from the profile's power per GPU."""
    pue = options.get("pue", 1.2)
    price = options.get("price_per_kwh", 0.10)
    carbon = options.get("carbon_g_per_kwh", 400.0)
    seconds = 1e9 / result["tokens_per_s"]
    kwh = seconds * result["gpus"] * cluster.profile.power_w * pue / 3.6e6
    return {"kwh_per_1b_tokens": kwh, "cost_per_1b_tokens": kwh * price,
            "co2_kg_per_1b_tokens": kwh * carbon / 1000}
