"""Context parallelism in the cost model: the K/V all-gather, its bytes, time and memory.

``cp`` ranks of one data-parallel replica read the same sequences; each holds two of ``2 cp``
equal chunks of every sequence (rank ``i`` chunks ``i`` and ``2 cp - 1 - i``, so causal
attention costs every rank the same), so every per-token cost of a block — GEMMs, element-wise
kernels, tensor-parallel messages, saved activations — is that of ``S / cp`` tokens, and
attention (local queries against the whole sequence's keys) is ``1 / cp`` of its full work.

Attention is the all-gather variant: in every attention layer and for every micro-batch a rank
all-gathers K and V over the cp group (each full-sequence tensor ``B × S × kv_dim / tp``
elements in the activation dtype) and in backward reduce-scatters dK and dV; when activation
checkpointing (full or selective) recomputes attention, its two all-gathers run again. Per
layer and micro-batch that is ``4 + 2·[recompute]`` collectives of ``(cp - 1) / cp`` times the
full tensor in bus bytes (nccl-tests convention, :func:`meshtrain.config.runtime_facts.bus_bytes`),
not overlapped with compute. The gathered K and V stay in memory for backward: ``2 B S kv_dim /
tp`` elements per layer and in-flight micro-batch without checkpointing, one layer's worth (the
block being recomputed) with it.

The cp group's ranks are ``tp`` apart in the mesh (tp innermost, then cp, then dp, pp
outermost): it stays within a node while ``tp × cp`` fits in one, else it crosses nodes.
Gradients reduce (and ZeRO shards) over the ``dp × cp`` ranks with the same ``tp`` stride.
"""

from __future__ import annotations

from meshtrain.config.layout import Layout
from meshtrain.planner.cost.workload import Workload
from meshtrain.planner.hardware.profile import Cluster


def kv_width(workload: Workload, layout: Layout) -> int:
    """Key (or value) features one tp rank computes: its share of the key/value heads (one
    whole head each when tp exceeds their count, as the runtime selects them) × head width."""
    model = workload.model
    return max(model.kv_heads // layout.tp, 1) * model.head_dim


def gathered_kv_bytes(workload: Workload, layout: Layout) -> float:
    """Bytes of one full-sequence K (or V) a rank gathers in one layer for one micro-batch:
    ``B × S × kv_dim / tp`` elements in the activation dtype (0 without cp)."""
    if layout.cp == 1:
        return 0.0
    b = layout.micro_batch_size(workload.global_batch)
    return b * workload.seq_len * kv_width(workload, layout) * workload.act_bytes


def collectives_per_layer(layout: Layout) -> int:
    """cp collectives per attention layer and micro-batch: all-gathers of K and V, reduce-
    scatters of dK and dV, and the all-gathers again when checkpointing recomputes attention."""
    return 4 + (2 if layout.activation_checkpointing in ("full", "selective") else 0)


def forward_share(layout: Layout) -> float:
    """Fraction of a layer's cp collectives in the forward pass (the two all-gathers)."""
    return 2 / collectives_per_layer(layout)


def layer_bus_bytes(workload: Workload, layout: Layout) -> float:
    """cp bus bytes per rank of one attention layer and micro-batch."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    return collectives_per_layer(layout) * (cp - 1) / cp * gathered_kv_bytes(workload, layout)


def layer_comm_time(workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """Seconds of cp communication in one attention layer for one micro-batch (exposed)."""
    if layout.cp == 1:
        return 0.0
    one = cluster.collective_time("all_gather", gathered_kv_bytes(workload, layout), layout.cp,
                                  layout.tp, "cp")
    return collectives_per_layer(layout) * one


def step_bus_bytes(workload: Workload, layout: Layout, n_layers: int) -> float:
    """cp bus bytes per rank in one step for a rank holding ``n_layers`` attention layers: what
    the runtime counts as ``comm_bytes.cp``."""
    return n_layers * layout.microbatches * layer_bus_bytes(workload, layout)


def saved_kv_bytes(workload: Workload, layout: Layout, n_layers: int, inflight: float) -> float:
    """Gathered K and V a rank holds at its peak: every layer's for each in-flight micro-batch
    without checkpointing; with it only the recomputed block's (the others keep local K/V)."""
    kv = 2 * gathered_kv_bytes(workload, layout)
    if layout.activation_checkpointing == "none":
        return kv * n_layers * inflight
    return kv if n_layers else 0.0


def reduction_group(layout: Layout) -> tuple[int, int]:
    """(size, stride) of the group dense gradients reduce over and ZeRO shards across: the
    ``dp × cp`` ranks of one tp rank and pipeline stage, ``tp`` apart."""
    return layout.dp * layout.cp, layout.tp
