"""Pricing the folded expert layout: who computes which assignments, and what the ep axis moves.

The runtime (:mod:`meshtrain.parallel.mesh`, :mod:`meshtrain.parallel.expert`) factors a stage's
``dp × tp`` ranks into ``ep`` expert groups of ``dp · tp / ep`` replicas each. Under tensor
parallelism every tp rank routes the same tokens and then dispatches only its ``1/tp`` share of
the sorted assignments, so with ``ep > 1`` a rank's expert work and all-to-all traffic are its
micro-batch's ``tokens × top_k`` assignments divided by ``tp`` (``row_split``), its expert
parameters are ``E / ep`` experts, and expert gradients are reduced (and ZeRO-sharded) over the
``dp · cp · tp / ep`` ranks holding the same experts. With ``ep = 1`` the MoE layer stays
replicated over tp (every tp rank computes every assignment).

The global-batch load balance (``model.moe_balance_scope = "global-batch"`` with the aux loss)
adds small all-reduces of expert counts over ``dp × cp`` (:func:`balance_reductions`) and, when a
rank runs several micro-batches or pipeline stages, a routing pre-pass: one forward of every
micro-batch (:func:`balance_prepass`), which the estimate adds to the step time.
"""

from __future__ import annotations

from meshtrain.config.layout import Layout
from meshtrain.config.runtime_facts import bus_bytes
from meshtrain.planner.cost.workload import Workload

COUNTS_BYTES = 8
"""Bytes per expert of the per-forward counts exchange (int64)."""


def row_split(layout: Layout) -> int:
    """Over how many tp ranks a micro-batch's assignments are divided (tp with ep > 1, else 1)."""
    return layout.tp if layout.ep > 1 else 1


def keeps_own_tokens(layout: Layout, sequence_sharded: bool) -> bool:
    """Whether each tp rank keeps its own sequence shard through an MoE layer: a stack that
    does so (``sequence_sharded``,
    :attr:`~meshtrain.planner.cost.runtime.RuntimeTraits.moe_sequence_sharded`) under sequence
    parallelism."""
    return sequence_sharded and layout.sequence_parallel


def token_split(layout: Layout, sequence_sharded: bool = False) -> int:
    """Over how many tp ranks an MoE layer's tokens and assignments are divided: ``tp`` when
    each tp rank keeps its own tokens (:func:`keeps_own_tokens`), else :func:`row_split`."""
    if keeps_own_tokens(layout, sequence_sharded):
        return layout.tp
    return row_split(layout)


def expert_reduction_size(layout: Layout, sequence_sharded: bool = False) -> int:
    """Ranks an expert parameter's gradient is reduced and ZeRO-sharded over: ``dp · cp · tp /
    ep`` with expert parallelism (or with tp ranks that route tokens of their own,
    :func:`token_split`), ``dp · cp`` (as every parameter) without."""
    split = token_split(layout, sequence_sharded)
    return max(layout.dp * layout.cp * split // layout.ep, 1)


def expert_reduction_stride(layout: Layout, sequence_sharded: bool = False) -> int:
    """Approximate rank distance between the members of an expert-data-parallel group (they
    are ``ep`` apart in the stage's ``dp × tp`` numbering)."""
    if layout.ep <= 1:
        return 1 if token_split(layout, sequence_sharded) > 1 else layout.tp
    return layout.ep * layout.cp


def routed_rows(workload: Workload, layout: Layout) -> float:
    """Assignments one rank dispatches per MoE layer and micro-batch (dropless)."""
    tokens = layout.micro_batch_size(workload.global_batch) * workload.seq_len / layout.cp
    split = token_split(layout, workload.traits.moe_sequence_sharded)
    return tokens * workload.model.moe_top_k / split


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
    """``comm_bytes.ep`` per rank in one step of a stage holding ``layers`` (with the global-batch
    balance's routing pre-pass, its forward dispatch, combine and counts exchange too)."""
    moe = workload.model.moe_layer_count(layers)
    total = moe * layout.microbatches * ep_layer_bus_bytes(workload, layout)
    if balance_prepass(workload, layout) and layout.ep > 1:
        share = (layout.ep - 1) / layout.ep
        rows = routed_rows(workload, layout) * workload.model.dim * workload.act_bytes
        counts = workload.model.moe_experts * COUNTS_BYTES
        total += moe * layout.microbatches * share * (2 * rows + counts)
    return total


def global_batch_balance(workload: Workload) -> bool:
    """Whether the run's aux loss is formed on the global batch's expert loads
    (``model.moe_balance_scope = "global-batch"``, :mod:`meshtrain.training.moe_balance`)."""
    model = workload.model
    return (bool(model.moe_experts) and model.moe_balance == "aux-loss"
            and model.moe_balance_scope == "global-batch")


def balance_prepass(workload: Workload, layout: Layout) -> bool:
    """Whether the global-batch balance needs its routing pre-pass: one forward of every
    micro-batch before the step, when a rank runs several micro-batches or pipeline stages."""
    return global_batch_balance(workload) and (layout.microbatches > 1 or layout.pp > 1)


def balance_reductions(workload: Workload, layout: Layout, layers: list[int]) -> list[int]:
    """Bytes of each all-reduce over the stage's ``dp × cp`` ranks that the global-batch balance
    adds per step for a stage holding ``layers`` (int64 counts): one of ``E`` counts per MoE
    layer in its forward, or with the pre-pass one ``[MoE layers, E]`` table; none otherwise."""
    moe = workload.model.moe_layer_count(layers)
    if not global_batch_balance(workload) or not moe:
        return []
    size = workload.model.moe_experts * COUNTS_BYTES
    return [moe * size] if balance_prepass(workload, layout) else [size] * moe


def balance_step_bus_bytes(workload: Workload, layout: Layout, layers: list[int]) -> int:
    """What :func:`balance_reductions` adds to ``comm_bytes.dp`` per rank and step."""
    group = layout.dp * layout.cp
    return sum(bus_bytes("all_reduce", size, group)
               for size in balance_reductions(workload, layout, layers))
