"""DiLoCo replica groups priced: what crosses between the groups, how often, and for how long.

With ``parallel.replicas = R`` the cluster's ranks form R replica groups of ``gpus / R`` ranks
(the outermost mesh dimension, :mod:`meshtrain.parallel.mesh`), each running the inner layout on
``global_batch / R`` sequences per step; the inner step is priced by
:func:`meshtrain.planner.cost.estimate.estimate` on one group's share of the cluster (its own site's
fabric when the groups are the sites, :func:`inner_cluster`). What the groups exchange is what
the runtime sends (:mod:`meshtrain.training.diloco.outer`), per rank:

- every step, one all-reduce of ``5 + R`` fp32 numbers (loss, aux loss, energy, gradient norm,
  tokens, and the tokens of each group) over the ``replica`` group: latency-bound, blocking;
- at the end of each fragment's round (every ``H = parallel.sync_every`` steps, fragments at
  staggered steps), the pseudo-gradient of the rank's fp32 master shard, which is all the
  rank's parameters under ZeRO-0 and ``1 / (dp · cp)`` of them from ZeRO-1 on: one all-reduce
  of ``shard × 4`` (fp32) or ``× 2`` (bf16) bytes, or for int8 / fp8 an all-to-all and an
  all-gather of one byte per value plus one fp32 scale per 256 values (padded to the group size
  × 256, :mod:`meshtrain.training.diloco.quantized_reduce`), ``(1 + 4/256)/4`` of fp32's bytes.

Bytes are bus bytes per rank (:func:`meshtrain.config.runtime_facts.bus_bytes`), the convention of
the runtime's ``comm_bytes.replica``; the replica group's collectives are timed by
:meth:`meshtrain.planner.hardware.profile.Cluster.collective_time` over ``R`` ranks ``gpus / R``
apart, so on a cluster split into sites (:mod:`meshtrain.planner.sites.wide_area`) they cross the
wide-area link, which every rank of a site shares. Each fragment's share of a rank's elements is the
runtime's own split (:func:`meshtrain.config.runtime_facts.fragment_of_parameters`) of the rank's
units (embedding, blocks, norm and head).

Amortised per inner step: a round's traffic and seconds over ``H``, plus the per-step numbers.
Without ``parallel.sync_overlap`` meshtrain exchanges each due fragment between two steps,
blocking, so all of it is exposed and added to the step (``replica_comm_exposed_s``). With
``sync_overlap = τ`` the exchange runs in the background during the next τ inner steps, as
Streaming DiLoCo does, and only ``max(0, sync − τ · inner step)`` per fragment is exposed (on
GPUs; on CPUs communication takes the cores compute needs, so nothing hides).
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ConfigError
from meshtrain.config.layout import Layout
from meshtrain.config.layout_rules import check_replica_keys
from meshtrain.config.runtime_facts import QUANTIZED_BLOCK as BLOCK
from meshtrain.config.runtime_facts import bus_bytes
from meshtrain.planner.cost.context_parallel import reduction_group
from meshtrain.planner.cost.estimate import _bound, energy_per_token, estimate
from meshtrain.planner.cost.memory import layer_params, stage_params
from meshtrain.planner.cost.offload import NO_OFFLOAD, Offload
from meshtrain.planner.cost.workload import Workload, stage_layers
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.sites.wide_area import WideArea

SCALE_BLOCK = BLOCK
"""Values per fp32 scale of the 8-bit formats."""


@dataclasses.dataclass(frozen=True)
class ReplicaSettings:
    """The DiLoCo keys of a run config's ``[parallel]`` section."""

    replicas: int = 1
    sync_every: int = 1
    sync_fragments: int = 1
    outer_grad_dtype: str = "fp32"
    sync_overlap: int = 0

    @classmethod
    def from_config(cls, parallel) -> ReplicaSettings:
        """The settings of a :class:`meshtrain.config.ParallelConfig`."""
        return cls(parallel.replicas, parallel.sync_every, parallel.sync_fragments,
                   parallel.outer_grad_dtype, parallel.sync_overlap)

    def to_dict(self) -> dict:
        """JSON form: the config keys and their values."""
        return dataclasses.asdict(self)


def check_replica_settings(settings: ReplicaSettings, workload: Workload, cluster: Cluster) -> None:
    """Raise :class:`ConfigError` naming the key and the valid values when ``settings`` cannot
    run ``workload`` on ``cluster``."""
    s, sites = settings, cluster.sites
    check_replica_keys(replicas=s.replicas, sync_every=s.sync_every,
                       sync_fragments=s.sync_fragments, outer_grad_dtype=s.outer_grad_dtype,
                       sync_overlap=s.sync_overlap, n_layers=workload.model.n_layers)
    if cluster.gpus % s.replicas:
        raise ConfigError(f"parallel.replicas = {s.replicas} does not divide the {cluster.gpus} "
                          "GPUs into equal replica groups.")
    if workload.global_batch % s.replicas:
        raise ConfigError(f"train.global_batch = {workload.global_batch} is not divisible by "
                          f"parallel.replicas = {s.replicas} (each group trains its share).")
    if sites > 1 and sites % s.replicas and s.replicas % sites:
        raise ConfigError(f"parallel.replicas = {s.replicas} on {sites} sites: a replica group "
                          "would straddle a site boundary; use a divisor or a multiple of "
                          f"{sites}.")


def inner_cluster(cluster: Cluster, replicas: int) -> Cluster:
    """One replica group's share of ``cluster``: ``gpus / replicas`` ranks, spanning
    ``sites / replicas`` sites when there are more sites than groups, else inside one, while
    all of the cluster's processes compute (what a shared CPU host's rates depend on)."""
    wan = cluster.wan
    if wan is not None and wan.sites > replicas:
        wan = WideArea(wan.sites // replicas, wan.wan_gbps, wan.wan_latency_ms)
    else:
        wan = None
    return dataclasses.replace(cluster, gpus=cluster.gpus // replicas, wan=wan,
                               busy_processes=cluster.busy_processes or cluster.gpus)


def inner_workload(workload: Workload, replicas: int) -> Workload:
    """One replica group's workload: its ``global_batch / replicas`` sequences per step."""
    return dataclasses.replace(workload, global_batch=workload.global_batch // replicas)


def rank_fragments(workload: Workload, layout: Layout, fragments: int) -> list[list[float]]:
    """Per pipeline stage, the pseudo-gradient elements one of its ranks holds in each
    fragment: its master shard, split as the runtime splits its units into fragments."""
    from meshtrain.config.runtime_facts import fragment_of_parameters

    model, lay = workload.model, layout
    zero_share = reduction_group(lay)[0] if lay.zero >= 1 else 1
    placement = stage_layers(model, lay)
    stages = []
    for r, layers in enumerate(placement):
        first, last = r == 0, r == lay.pp - 1
        sp = stage_params(model, layers, lay, first, last)
        shard = sp.dense / zero_share + sp.expert / max(zero_share // lay.ep, 1)
        sizes = [(f"layers.{layer}.", sum(layer_params(model, layer, lay.tp, lay.ep)))
                 for layer in layers]
        vocab = model.vocab_size * model.dim / lay.tp
        if first:
            sizes.insert(0, ("tok_embeddings.weight", vocab))
        if last:
            sizes.append(("output.weight", model.dim
                          + (0 if first and model.tie_embeddings else vocab)))
        where = fragment_of_parameters(sizes, fragments)
        total = sum(n for _, n in sizes)
        per_fragment = [0.0] * fragments
        for name, n in sizes:
            per_fragment[where[name]] += shard * n / total
        stages.append(per_fragment)
    return stages


def sync_bus_bytes(elements: float, replicas: int, dtype: str) -> int:
    """Bus bytes per rank of one pseudo-gradient exchange of ``elements`` values."""
    n = int(round(elements))
    if dtype in ("int8", "fp8"):
        padded = -(-n // (replicas * SCALE_BLOCK)) * SCALE_BLOCK * replicas
        scales = padded // SCALE_BLOCK * 4
        return sum(bus_bytes(op, size, replicas) for op in ("all_to_all", "all_gather")
                   for size in (padded, scales))
    return bus_bytes("all_reduce", n * (4 if dtype == "fp32" else 2), replicas)


def sync_seconds(cluster: Cluster, elements: float, replicas: int, dtype: str) -> float:
    """Seconds of one pseudo-gradient exchange over the replica group (``gpus / R`` apart)."""
    stride = cluster.gpus // replicas
    if dtype in ("int8", "fp8"):
        padded = -(-elements // (replicas * SCALE_BLOCK)) * SCALE_BLOCK * replicas
        return sum(cluster.collective_time(op, size, replicas, stride)
                   for op in ("all_to_all", "all_gather")
                   for size in (padded, padded / SCALE_BLOCK * 4))
    return cluster.collective_time("all_reduce", elements * (4 if dtype == "fp32" else 2),
                                   replicas, stride)


def metrics_values(replicas: int) -> int:
    """fp32 numbers the groups all-reduce every step (see the module doc)."""
    return 5 + replicas


def replica_traffic(workload: Workload, layout: Layout, cluster: Cluster,
                    settings: ReplicaSettings, inner_step_s: float) -> dict:
    """The ``replica_*`` fields of an estimate (see the module doc): bytes per rank per round,
    per sync and per step, and seconds per step, for the stage whose ranks move the most."""
    s, r = settings, settings.replicas
    stages = rank_fragments(workload, layout, s.sync_fragments)
    per_stage = [[sync_bus_bytes(e, r, s.outer_grad_dtype) for e in fragments]
                 for fragments in stages]
    heaviest = max(range(len(stages)), key=lambda i: sum(per_stage[i]))
    fragments = stages[heaviest]
    times = [sync_seconds(cluster, e, r, s.outer_grad_dtype) for e in fragments]
    stride = cluster.gpus // r
    metric_bytes = bus_bytes("all_reduce", metrics_values(r) * 4, r)
    metric_s = cluster.collective_time("all_reduce", metrics_values(r) * 4, r, stride)
    round_bytes = sum(per_stage[heaviest])
    window = s.sync_overlap * inner_step_s if cluster.profile.comm_overlaps_compute else 0.0
    round_s = sum(times)
    exposed = sum(max(0.0, t - window) for t in times)
    return {
        "replica_round_bytes": round_bytes,
        "replica_sync_bytes_max": max(per_stage[heaviest]),
        "replica_step_metrics_bytes": metric_bytes,
        "replica_comm_bytes": round_bytes / s.sync_every + metric_bytes,
        "replica_round_s": round_s,
        "replica_comm_s": round_s / s.sync_every + metric_s,
        "replica_comm_exposed_s": exposed / s.sync_every + metric_s,
        "replica_sync_s_max": max(times, default=0.0),
        "replica_elements_per_rank": sum(fragments),
    }


def estimate_replicated(workload: Workload, layout: Layout, cluster: Cluster,
                        settings: ReplicaSettings, energy: dict | None = None,
                        inner: dict | None = None, offload: Offload = NO_OFFLOAD) -> dict:
    """Price ``layout`` as the inner layout of ``settings.replicas`` DiLoCo replica groups on
    ``cluster`` (``workload``: the whole job's batch); an estimate dict whose step adds the
    exposed replica traffic, with the ``replica_*`` fields and ``replicas`` settings.
    ``inner``: the inner layout's estimate on :func:`inner_cluster`, when already priced;
    ``offload``: the ``parallel.offload*`` settings (the outer state is offloaded too)."""
    check_replica_settings(settings, workload, cluster)
    r = settings.replicas
    if inner is None:
        inner = estimate(inner_workload(workload, r), layout, inner_cluster(cluster, r), energy,
                         use_simulator=False, offload=offload, replicas=r)
    traffic = replica_traffic(workload, layout, cluster, settings, inner["step_time_s"])
    inner_step = inner["step_time_s"]
    step = inner_step + traffic["replica_comm_exposed_s"]
    slower = inner_step / step
    result = dict(inner)
    result.update(traffic)
    result["breakdown"] = {**inner["breakdown"],
                           "replica_comm_exposed_s": traffic["replica_comm_exposed_s"]}
    tokens = inner["tokens_per_step"] * r
    result.update(
        gpus=cluster.gpus, tokens_per_step=tokens, step_time_s=step, tokens_per_s=tokens / step,
        inner_step_time_s=inner_step, replicas=settings.to_dict(),
        bubble_fraction=inner["bubble_fraction"] * slower,
        **{key: inner[key] * slower for key in ("model_tflops_per_gpu",
                                                 "hardware_tflops_per_gpu", "mfu", "hfu")})
    result["bound"] = _bound(result["breakdown"])
    result.update(energy_per_token(result, cluster, energy or {}))
    return result
