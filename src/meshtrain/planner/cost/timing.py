"""Time of one micro-batch through one block on one rank: compute and tensor/expert comm.

Compute is priced GEMM by GEMM with a roofline: ``max(2mnk / (peak · e), bytes / HBM) + t0``,
where ``e`` is the large-GEMM efficiency the stack reaches on the profile
(:func:`meshtrain.planner.hardware.stack_efficiency.kernel_efficiency`: the stack's entry for the
GPU generation, else the profile's) and ``t0`` the profile's per-kernel overhead — so small
per-rank matmuls (high tp, small micro-batches, narrow models) run below peak, as they do. The
backward of a linear layer is two GEMMs of the same size (input gradient ``b``, weight gradient
``w``). Attention's ``QK^T`` and ``AV`` run fused (FlashAttention: causal, so half the square,
at the stack's or else the profile's attention efficiency relative to the GEMM rate, backward
2.5× forward; a calibrated profile gives both by head width) or, for runtimes without it, as
batched GEMMs plus a softmax that streams the ``s × s`` scores through HBM. Element-wise work
(norms, rotary, activation function, residual adds) is memory-bound: it moves a few times the
block's saved activations through HBM (``RuntimeTraits.elementwise_traffic``).

Tensor-parallel communication per block and micro-batch: two all-reduces forward and two backward
(with sequence parallelism, all-gather + reduce-scatter pairs of the same bus volume), two more
when full checkpointing recomputes the forward; not overlapped. Once per micro-batch also the
vocab-parallel embedding's forward all-reduce (first stage), the head input's backward
all-reduce and the loss's two small ones (last stage). Expert parallelism: a dispatch and
a combine all-to-all forward, the same backward. Context parallelism: a rank prices its ``S / cp``
tokens, attention at ``1 / cp`` of the whole sequence's, and the K/V all-gathers and dK/dV
reduce-scatters of :mod:`meshtrain.planner.cost.context_parallel` (``cp_comm``, not overlapped).
Stacks that pipeline their tp collectives with the GEMMs (``RuntimeTraits.tp_comm_overlap``) or
their cp exchange with attention (``cp_comm_overlap``) expose only the first of the ring's
steps and whatever outlasts that compute (:func:`meshtrain.planner.cost.overlap.
pipelined_exposed`); the hidden seconds are ``tp_hidden`` and ``cp_hidden``.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.planner.cost.context_parallel import layer_comm_time
from meshtrain.planner.cost.expert_parallel import keeps_own_tokens, routed_rows, token_split
from meshtrain.planner.cost.memory import layer_activation_bytes
from meshtrain.planner.cost.overlap import contended, paired_exposed, pipelined_exposed
from meshtrain.planner.cost.workload import Workload
from meshtrain.planner.hardware.profile import Cluster
from meshtrain.planner.hardware.stack_efficiency import KernelEfficiency, kernel_efficiency

FLASH_BACKWARD_RATIO = 2.5
"""FlashAttention backward time over forward (FlashAttention-2 paper, Dao 2023)."""


@dataclasses.dataclass
class BlockCost:
    """Seconds for one micro-batch through one block (or the head) on one rank."""

    forward: float = 0.0
    backward_input: float = 0.0
    backward_weight: float = 0.0
    recompute: float = 0.0
    tp_comm: float = 0.0
    ep_comm: float = 0.0
    cp_comm: float = 0.0
    """Context-parallel K/V all-gathers and dK/dV reduce-scatters (recompute's included)."""
    tp_hidden: float = 0.0
    """Tensor-parallel communication hidden behind the block's GEMMs (``tp_comm`` is what
    stays exposed; 0 unless ``RuntimeTraits.tp_comm_overlap``)."""
    ep_hidden: float = 0.0
    """Expert all-to-alls hidden behind another micro-batch's compute
    (``RuntimeTraits.ep_comm_overlap``)."""
    cp_hidden: float = 0.0
    """Context-parallel communication hidden behind attention
    (``RuntimeTraits.cp_comm_overlap``)."""
    flops: float = 0.0
    """Hardware FLOPs executed on this rank (forward + backward + recompute)."""
    recompute_flops: float = 0.0

    def add(self, other: BlockCost, times: float = 1.0) -> None:
        """Accumulate ``times`` copies of ``other`` into this cost."""
        for name in _FIELDS:
            setattr(self, name, getattr(self, name) + times * getattr(other, name))

    @property
    def compute(self) -> float:
        """Compute seconds (forward, both backwards, recompute)."""
        return self.forward + self.backward_input + self.backward_weight + self.recompute


_FIELDS = tuple(f.name for f in dataclasses.fields(BlockCost))


class GemmClock:
    """Roofline pricing of GEMMs on one profile, at the efficiency ``kernels`` gives (``fp8``:
    FP8 GEMMs, at the profile's FP8 peak and the stack's FP8 efficiency, one byte an element)."""

    def __init__(self, cluster: Cluster, dtype_bytes: int, kernels: KernelEfficiency,
                 fp8: bool = False):
        p = cluster.profile
        peak, hbm = cluster.process_rates()
        if fp8:
            self.rate = peak * 1e12 * p.fp8_rate * kernels.fp8_gemm
            dtype_bytes = 1
        else:
            self.rate = peak * 1e12 * kernels.gemm * (1.0 if dtype_bytes == 2 else p.fp32_rate)
        self.hbm = hbm * 1e9
        self.overhead = p.kernel_overhead_us * 1e-6
        self.dtype_bytes = dtype_bytes

    def gemm(self, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """Seconds for ``batch`` GEMMs of ``[m, k] x [k, n]`` (one kernel)."""
        flops = 2.0 * m * n * k * batch
        traffic = self.dtype_bytes * (m * k + k * n + m * n) * batch
        return max(flops / self.rate, traffic / self.hbm) + self.overhead

    def stream(self, nbytes: float, kernels: int = 1) -> float:
        """Seconds for memory-bound kernels moving ``nbytes`` through HBM."""
        return nbytes / self.hbm + kernels * self.overhead


def _linear_shapes(model: ModelConfig, layer: int, tokens: float, layout: Layout,
                   moe_sequence_sharded: bool = False) -> list[tuple[float, float, float, float]]:
    """(m, n, k, batch) of each forward GEMM in a block on one rank (``moe_sequence_sharded``:
    ``RuntimeTraits.moe_sequence_sharded``)."""
    t, h, hd = layout.tp, model.dim, model.head_dim
    q_width, kv_width = model.n_heads * hd / t, model.kv_heads * hd / t
    shapes = [(tokens, q_width + 2 * kv_width, h, 1), (tokens, h, q_width, 1)]
    up = 2 if model.mlp == "swiglu" else 1
    if not model.is_moe_layer(layer):
        f = model.ffn_dim / t
        return shapes + [(tokens, up * f, h, 1), (tokens, h, f, 1)]
    # Router and shared experts are replicated over tp; with ep > 1 the routed experts are
    # folded over the tp ranks, each computing its 1/tp share (planner.expert_parallel). A
    # stack whose tp ranks keep their own tokens through the layer runs all of it on S/tp.
    f = model.expert_ffn_dim
    local = model.moe_experts / layout.ep
    split = token_split(layout, moe_sequence_sharded)
    own = tokens / split if keeps_own_tokens(layout, moe_sequence_sharded) else tokens
    per_expert = tokens * model.moe_top_k * layout.ep / model.moe_experts / split
    shapes += [(own, model.moe_experts, h, 1), (per_expert, up * f, h, local),
               (per_expert, h, f, local)]
    if model.moe_shared_experts:
        shared = model.shared_ffn_dim
        shapes += [(own, up * shared, h, 1), (own, h, shared, 1)]
    return shapes


def block_cost(workload: Workload, layout: Layout, cluster: Cluster, layer: int) -> BlockCost:
    """Cost of one micro-batch through block ``layer`` on one rank."""
    model, lay, traits = workload.model, layout, workload.traits
    kernels = kernel_efficiency(traits.kernel_efficiency, cluster.profile)
    clock = GemmClock(cluster, workload.act_bytes, kernels)
    # The linear layers' own clock: FP8 GEMMs when the run computes them in FP8.
    linear = GemmClock(cluster, workload.act_bytes, kernels, fp8=True) if traits.fp8_linear \
        else clock
    b, s = lay.micro_batch_size(workload.global_batch), workload.seq_len
    tokens = b * s / lay.cp  # this rank's share of every sequence
    heads = model.n_heads / lay.tp
    cost = BlockCost()

    linear_flops = linear_time = 0.0
    shapes = _linear_shapes(model, layer, tokens, lay, traits.moe_sequence_sharded)
    attention_gemms = 0.0  # one pass of the qkv and output projections (the first two shapes)
    for index, (m, n, k, batch) in enumerate(shapes):
        one = linear.gemm(m, n, k, batch)
        cast_input = cast_grad = 0.0
        if traits.fp8_linear:
            # The FP8 operands made on the fly, each with the transpose Hopper's weight-gradient
            # GEMM takes (one fused cast-transpose: read bf16, write FP8 twice, 4 bytes an
            # element): the input forward, the output gradient backward. The weights are cast
            # once a step.
            cast_input = clock.stream(4.0 * m * k * batch)
            cast_grad = clock.stream(4.0 * m * n * batch)
        attention_gemms += one + cast_input if index < 2 else 0.0
        cost.forward += one + cast_input
        cost.backward_input += one + cast_grad
        cost.backward_weight += one
        linear_flops += 2.0 * m * n * k * batch
        linear_time += 3 * one + cast_input + cast_grad

    if model.is_moe_layer(layer) and kernels.expert_overhead_s:
        # The stack's per-expert work beyond the GEMMs' roofline: for each token the rank
        # routes, for each local expert (StackEfficiency.expert_overhead_ns), spread over the
        # forward and the two backward passes alike.
        routed = routed_rows(workload, lay) / model.moe_top_k  # tokens, not assignments
        per_pass = routed * model.moe_experts / lay.ep * kernels.expert_overhead_s / 3
        cost.forward += per_pass
        cost.backward_input += per_pass
        cost.backward_weight += per_pass

    # QK^T and AV, full square; the rank's queries against the whole sequence's keys
    attention_flops = 4.0 * b * s * s * heads * model.head_dim / lay.cp
    if traits.flash_attention:
        efficiency, backward = cluster.profile.attention_figures(model.head_dim,
                                                                 FLASH_BACKWARD_RATIO)
        efficiency = kernels.attention or efficiency
        attention_fwd = 0.5 * attention_flops / (clock.rate * efficiency) + clock.overhead
        attention_bwd = backward * attention_fwd
    else:
        queries = s / lay.cp
        scores = b * heads * queries * s * workload.act_bytes
        attention_fwd = (2 * clock.gemm(queries, s, model.head_dim, b * heads)
                         + clock.stream(3 * scores, kernels=2))
        attention_bwd = (4 * clock.gemm(queries, s, model.head_dim, b * heads)
                         + clock.stream(4 * scores, kernels=2))
    saved = layer_activation_bytes(workload, lay, layer, "none", as_run=False)
    elementwise = clock.stream(traits.elementwise_traffic * saved, kernels=8)
    cost.forward += attention_fwd + elementwise
    cost.backward_input += attention_bwd + 2 * elementwise

    mode = lay.activation_checkpointing
    if mode == "full":
        cost.recompute = cost.forward
        cost.recompute_flops = linear_flops + attention_flops
    elif mode == "selective" and traits.selective_policy == "op" and not model.is_moe_layer(layer):
        # torchtitan's per-op policy reruns the block but keeps SDPA and the odd matmuls:
        # what runs again is wk (of the fused qkv), wo, w3 (half the fused up) and every
        # element-wise kernel.
        qkv, wo, up = shapes[0], shapes[1], shapes[2]
        kv = model.kv_heads * model.head_dim / lay.tp
        parts = ((qkv, kv / qkv[1]), (wo, 1.0), (up, 0.5 if model.mlp == "swiglu" else 0.0))
        for (m, n, k, batch), share in parts:
            if share:
                cost.recompute += linear.gemm(m, n * share, k, batch)
                cost.recompute_flops += 2.0 * m * n * share * k * batch
        cost.recompute += elementwise
    elif mode == "selective":
        cost.recompute = attention_fwd + 0.3 * elementwise
        cost.recompute_flops = attention_flops
    cost.flops = 3 * (linear_flops + attention_flops) + cost.recompute_flops

    if lay.tp > 1:
        message = tokens * model.dim * workload.act_bytes
        # Attention and MLP each reduce once forward and once backward; a replicated MoE layer
        # reduces nothing (without sp), with sp it gathers its input forward and backward.
        sharded = keeps_own_tokens(lay, traits.moe_sequence_sharded)
        moe_plain = model.is_moe_layer(layer) and (not lay.sequence_parallel or sharded)
        collectives = (2 if moe_plain else 4) + (2 if mode == "full" else 0)
        if lay.sequence_parallel:
            # Each all-reduce becomes an all-gather and a reduce-scatter: the same bus bytes,
            # twice the collectives' fixed costs (the ring's steps, twice).
            one = (cluster.collective_time("all_gather", message, lay.tp, 1, "tp")
                   + cluster.collective_time("reduce_scatter", message, lay.tp, 1, "tp"))
        else:
            one = cluster.collective_time("all_reduce", message, lay.tp, 1, "tp")
        cost.tp_comm = collectives * one
        if lay.ep > 1 and model.is_moe_layer(layer) and not sharded:
            # Folded experts: the tp ranks' shares of the expert outputs are all-gathered
            # forward, the shares' input gradients backward (parallel.expert.fold).
            rows = tokens * model.moe_top_k * model.dim * workload.act_bytes
            gathers = 2 + (1 if mode == "full" else 0)
            cost.tp_comm += gathers * cluster.collective_time("all_gather", rows, lay.tp, 1, "tp")
    if lay.ep > 1 and model.is_moe_layer(layer):
        # Each rank dispatches its share of the micro-batch's assignments (1/tp of them).
        routed = routed_rows(workload, lay) * model.dim * workload.act_bytes
        all_to_alls = 4 + (2 if mode == "full" else 0)
        stride = 1 if lay.cp == 1 else lay.cp
        cost.ep_comm = all_to_alls * cluster.collective_time("all_to_all", routed, lay.ep,
                                                            stride, "ep")
    contention = cluster.profile.overlap_contention
    if traits.ep_comm_overlap and cost.ep_comm:
        # Each all-to-all runs beside one compute module of another micro-batch: the backward
        # combine beside the attention forward, the forward dispatch beside the experts'
        # backward, the backward dispatch beside the experts' forward, the forward combine
        # beside the attention backward. Recomputation's dispatch and combine stay exposed.
        experts = linear_time / 3 - attention_gemms  # one pass of the MoE layer's products
        slots = (attention_gemms + attention_fwd, 2 * experts, experts,
                 2 * attention_gemms + attention_bwd)
        each = cost.ep_comm / all_to_alls
        exposed = contended(paired_exposed(each, slots) + each * (all_to_alls - len(slots)),
                            cost.ep_comm, contention)
        cost.ep_hidden, cost.ep_comm = cost.ep_comm - exposed, exposed
    cost.cp_comm = layer_comm_time(workload, lay, cluster)
    if traits.tp_comm_overlap and cost.tp_comm:
        exposed = contended(pipelined_exposed(cost.tp_comm, linear_time, lay.tp), cost.tp_comm,
                            contention)
        cost.tp_hidden, cost.tp_comm = cost.tp_comm - exposed, exposed
    if traits.cp_comm_overlap and cost.cp_comm:
        attention = attention_fwd + attention_bwd + (attention_fwd if mode != "none" else 0.0)
        exposed = contended(pipelined_exposed(cost.cp_comm, attention, lay.cp), cost.cp_comm,
                            contention)
        cost.cp_hidden, cost.cp_comm = cost.cp_comm - exposed, exposed
    return cost


def head_cost(workload: Workload, layout: Layout, cluster: Cluster) -> BlockCost:
    """The LM head and loss on the last stage, one micro-batch."""
    model = workload.model
    clock = GemmClock(cluster, workload.act_bytes,
                      kernel_efficiency(workload.traits.kernel_efficiency, cluster.profile))
    tokens = layout.micro_batch_size(workload.global_batch) * workload.seq_len / layout.cp
    vocab = model.vocab_size / layout.tp
    one = clock.gemm(tokens, vocab, model.dim)
    loss = clock.stream(3 * tokens * vocab * 4, kernels=3)  # fp32 softmax / cross-entropy
    cost = BlockCost(forward=one + loss, backward_input=one + loss, backward_weight=one,
                     flops=3 * 2.0 * tokens * vocab * model.dim)
    if layout.tp > 1:
        # The head's input enters the tp region (an all-reduce of its gradient in backward);
        # the vocab-parallel loss all-reduces the token max, then sum-exp with target logit.
        # (With sequence parallelism an all-gather and a reduce-scatter: the same bus bytes.)
        hidden = tokens * model.dim * workload.act_bytes
        cost.tp_comm = (cluster.collective_time("all_reduce", hidden, layout.tp, 1, "tp")
                        + cluster.collective_time("all_reduce", tokens * 4, layout.tp, 1, "tp")
                        + cluster.collective_time("all_reduce", tokens * 8, layout.tp, 1, "tp"))
    return cost


def embedding_tp_cost(workload: Workload, layout: Layout, cluster: Cluster) -> float:
    """The vocab-parallel embedding's forward all-reduce (reduce-scatter with sequence
    parallelism, same bus bytes per rank) on the first stage, one micro-batch."""
    if layout.tp == 1:
        return 0.0
    tokens = layout.micro_batch_size(workload.global_batch) * workload.seq_len / layout.cp
    return cluster.collective_time("all_reduce", tokens * workload.model.dim
                                   * workload.act_bytes, layout.tp, 1, "tp")
