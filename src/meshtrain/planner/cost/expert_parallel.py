"""Pricing the folded expert layout: who computes which assignments, and what the ep axis moves.

The runtime (:mod:`meshtrain.parallel.mesh`, :mod:`meshtrain.parallel.expert`) factors a stage's
``dp × tp`` ranks into ``ep`` expert groups of ``dp · tp / ep`` replicas each. Under tensor
parallelism every tp rank routes the same tokens and then dispatches only its ``1/tp`` share of
the sorted assignments, so with ``ep > 1`` a rank's expert work and all-to-all traffic are its
micro-batch's ``tokens × top_k`` assignments divided by ``tp`` (``row_split``), its expert
parameters are ``E / ep`` experts, and expert gradients are reduced (and ZeRO-sharded) over the
``dp · cp · tp / ep`` ranks holding the same experts. With ``ep = 1`` the MoE layer stays
replicated over tp (every tp rank computes every assignment).
"""

from __future__ import annotations

from meshtrain.config.layout import Layout
from meshtrain.planner.cost.workload import Workload

COUNTS_BYTES = 8
"""Bytes per expert of the per-forward counts exchange (int64)."""


def row_split(layout: Layout) -> int:
    """Over how many tp ranks a micro-batch's assignments are divided (tp with ep > 1, else 1)."""
    return layout.tp if layout.ep > 1 else 1


def expert_reduction_size(layout: Layout) -> int:
    """Ranks an expert parameter's gradient is reduced and ZeRO-sharded over: ``dp · cp · tp /
    ep`` with expert parallelism, ``dp · cp`` (as every parameter) without."""
    return max(layout.dp * layout.cp * row_split(layout) // layout.ep, 1)


def expert_reduction_stride(layout: Layout) -> int:
    """Approximate rank distance between the members of an expert-data-parallel group (they
    are ``ep`` apart in the stage's ``dp × tp`` numbering)."""
    if layout.ep <= 1:
        return layout.tp
    return layout.ep * layout.cp


def routed_rows(workload: Workload, layout: Layout) -> float:
    """Assignments one rank dispatches per MoE layer and micro-batch (dropless)."""
    tokens = layout.micro_batch_size(workload.global_batch) * workload.seq_len / layout.cp
    return tokens * workload.model.moe_top_k / row_split(layout)


def ep_layer_bus_bytes(workload: Workload, layout: Layout) -> float:
    """``comm_bytes.ep`` of one MoE layer and micro-batch, averaged over the ranks (dropless):
    dispatch, combine and their two backward mirrors, each ``(ep - 1)/ep`` of the rows it moves
    (the comm layer's convention), plus the counts exchange of every forward (twice with full
    activation checkpointing, whose recomputation dispatches again)."""
    ep = layout.ep
    if ep <= 1:
        return 0.0
    share = (ep - 1) / ep
    forwards = 2 if layout.activation_checkpointing == "full" else 1
    rows = routed_rows(workload, layout) * workload.model.dim * workload.act_bytes
    counts = workload.model.moe_experts * COUNTS_BYTES
    return share * ((2 + 2 * forwards) * rows + forwards * counts)


def ep_step_bus_bytes(workload: Workload, layout: Layout, layers: list[int]) -> float:
    """``comm_bytes.ep`` per rank in one step of a stage holding ``layers``."""
    moe = workload.model.moe_layer_count(layers)
    return moe * layout.microbatches * ep_layer_bus_bytes(workload, layout)
