"""Per-rank memory: model states by ZeRO stage, activations by schedule, buffers.

Model states follow Rajbhandari et al. 2020 ("ZeRO", 3.1 and 5): mixed-precision Adam keeps
2 bytes of bf16 parameters, G of gradients and K = 12 of optimizer state (fp32 master, momentum,
variance) per parameter; fp32 training keeps 4 + 4 + 8. The ZeRO paper counts G = 2 (fp16
gradients); meshtrain, like Megatron-LM, accumulates and reduces bf16 models' gradients in fp32
(G = 4, ``RuntimeTraits.grad_reduce_bytes``) unless ``parallel.grad_reduce_dtype = bf16``
(G = 2). Over N data-parallel ranks:

=======  =================  ==================  ================
stage    parameters          gradients           optimizer
=======  =================  ==================  ================
0        2P                  GP                  12P
1        2P                  GP                  12P / N
2        2P                  GP / N              12P / N
3        2P / N              GP / N              12P / N
=======  =================  ==================  ================

Activations follow Korthikanti et al. 2022 (4, "Reducing Activation Recomputation"), who count
``sbh(34 + 5as/h)`` bytes per GPT layer; here the same accounting is redone for a Llama block
(RMSNorm, GQA, SwiGLU or GELU, no dropout): tensors saved for backward, in ``s b h`` units of the
activation dtype. Without sequence parallelism the norm inputs and the inputs of the first matmul
of each sub-block are replicated over tp; with it everything is divided by tp. Fused attention
keeps no ``s × s`` scores; unfused attention adds ``2 a s / h`` (the softmax output). Full
checkpointing keeps only each block's input (plus one block's working set while it recomputes);
selective recomputes the attention core and the MLP activation function. At the peak, the
backward of one block also holds the gradients of what it saved (one block's activations more).
A MoE layer is a replicated region under tp (every tp rank routes the whole, gathered
sequence); with ep = 1 each tp rank also computes every assignment, with ep > 1 the experts are
folded over the tp ranks and each computes its 1/tp share of the assignments, whose outputs are
all-gathered back whole (:mod:`meshtrain.planner.cost.expert_parallel`). A rank holds its
stage's activations times the schedule's peak in-flight micro-batches
(:mod:`meshtrain.planner.cost.pipeline`). Under context parallelism a rank's activations are
those of its ``S / cp`` tokens, plus the gathered full-sequence K and V
(:mod:`meshtrain.planner.cost.context_parallel`), and ZeRO shards over the ``dp × cp`` ranks.

What the stack does changes these counts (:class:`~meshtrain.planner.cost.runtime.RuntimeTraits`):
a fused SwiGLU keeps ``6 f/h`` units for its MLP instead of eager PyTorch's ``8 f/h``
(``fused_swiglu``); FSDP2 keeps the sharded parameters in fp32 with no separate master copy,
``4 + G + 8`` bytes per parameter (``fp32_params``); a run may keep its optimizer state in bf16
(``optimizer_state_bytes``); Megatron-LM's distributed optimizer reduce-scatters in place
(``zero1_reduce_in_place``). On a GPU the caching allocator holds a reserve beyond the live
tensors (fragmentation): ``RankMemory.reserve_bytes``, the profile's ``allocator_reserve``
fraction of the rest.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ModelConfig
from meshtrain.config.layout import Layout
from meshtrain.config.model_size import attention_params, mlp_params, norm_params
from meshtrain.config.runtime_facts import INITIAL_PAIRS
from meshtrain.planner.cost.context_parallel import saved_kv_bytes
from meshtrain.planner.cost.expert_parallel import (
    expert_reduction_size,
    keeps_own_tokens,
    row_split,
)
from meshtrain.planner.cost.workload import Workload

GB = 1e9


def model_state_bytes(params: float, zero: int, dp: int, precision: str = "bf16",
                      grad_bytes: int = 4, fp32_params: bool = False,
                      optimizer_bytes: float = 12.0) -> tuple[float, float, float]:
    """(parameter, gradient, optimizer) bytes per rank for ``params`` parameters replicated over
    ``dp`` ranks under ZeRO stage ``zero`` (the table in the module docstring); ``grad_bytes``
    is G, the bytes of a bf16 model's gradient element (fp32 models always keep 4);
    ``fp32_params``: the parameters themselves are the fp32 master copy (FSDP2 with a bf16
    mixed-precision policy), so a bf16 model keeps 4 + G + 8; ``optimizer_bytes``: a bf16
    model's master copy and Adam moments per parameter (12 in fp32, 6 in bf16)."""
    param_b, grad_b, optim_b = (2, grad_bytes, optimizer_bytes) if precision == "bf16" \
        else (4, 4, 8)
    if fp32_params and precision == "bf16":
        param_b, optim_b = 4, optimizer_bytes - 4
    n = max(dp, 1)
    param = params * param_b / (n if zero >= 3 else 1)
    grad = params * grad_b / (n if zero >= 2 else 1)
    optim = params * optim_b / (n if zero >= 1 else 1)
    return param, grad, optim


@dataclasses.dataclass
class StageParams:
    """Parameters one rank of a pipeline stage holds: dense (replicated over dp) and expert
    (replicated over the dp × tp / ep ranks holding the same experts)."""

    dense: float
    expert: float
    largest_layer: float
    """Largest block's parameters on this rank (what ZeRO-3 gathers at once)."""


def _layer_params(model: ModelConfig, layer: int, tp: int, ep: int) -> tuple[float, float]:
    attention = attention_params(model) / tp + norm_params(model)
    if not model.is_moe_layer(layer):
        return attention + mlp_params(model, model.ffn_dim) / tp, 0.0
    # Router and shared experts are whole on every tp rank (meshtrain.parallel.tensor.apply,
    # style ``replicated``); the routed experts are split over ep (folded over tp when ep > 1).
    expert = mlp_params(model, model.expert_ffn_dim)
    shared = mlp_params(model, model.shared_ffn_dim) + (model.dim if model.moe_shared_gate else 0)
    dense = attention + model.dim * model.moe_experts + shared
    return dense, model.moe_experts * expert / ep


def layer_params(model: ModelConfig, layer: int, tp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters of block ``layer`` on one rank at tensor degree ``tp`` and
    expert degree ``ep``."""
    return _layer_params(model, layer, tp, ep)


def stage_params(model: ModelConfig, layers: list[int], layout: Layout, first: bool,
                 last: bool) -> StageParams:
    """Parameters on one rank of the stage holding ``layers``."""
    dense = expert = largest = 0.0
    moe = model.moe_layer_count(layers)
    for count, layer in ((len(layers) - moe, 0), (moe, model.first_moe_layer)):
        if count:
            d, e = _layer_params(model, layer, layout.tp, layout.ep)
            dense, expert, largest = dense + count * d, expert + count * e, max(largest, d + e)
    vocab_shard = model.vocab_size * model.dim / layout.tp
    if first:
        dense += vocab_shard
    if last:
        dense += model.dim + (0 if (first and model.tie_embeddings) else vocab_shard)
    return StageParams(dense, expert, largest)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            mode: str = "none") -> float:
    """Activation bytes of one GPT layer (with dropout, 16-bit) per micro-batch per tp rank,
    Korthikanti et al. 2022, Table 2: ``sbh(10 + 24/t + 5as/(ht))`` with tp, ``sbh(34/t +
    5as/(ht))`` with tp and sp; selective recomputation drops the ``5as/h`` term; full keeps
    the layer input, ``2sbh`` (divided by t under sp, as the runtime shards it)."""
    if mode == "full":
        return 2.0 * s * b * h / (t if sp else 1)
    attention = 0.0 if mode == "selective" else 5.0 * a * s / (h * t)
    return s * b * h * ((34.0 / t if sp else 10.0 + 24.0 / t) + attention)


def layer_activation_units(model: ModelConfig, layer: int, seq_len: int, layout: Layout,
                           flash: bool, mode: str | None = None,
                           policy: str = "modules", fused_swiglu: bool = False,
                           moe_sequence_sharded: bool = False,
                           moe_gate_in_activation: bool = False,
                           fp8_linear: bool = False,
                           memory_efficient_norm: bool = False) -> float:
    """Bytes one block saves for one sequence, in units of ``s * h`` bytes at 2 bytes per
    element (Korthikanti et al.'s unit: their GPT layer is ``34 + 5 a s / h`` of them).
    ``policy``: what selective recomputation keeps (``RuntimeTraits.selective_policy``);
    ``fused_swiglu``: the SwiGLU kernel keeps only its input (``RuntimeTraits.fused_swiglu``);
    ``moe_sequence_sharded``: each tp rank keeps its own tokens through an MoE layer
    (``RuntimeTraits.moe_sequence_sharded``); ``moe_gate_in_activation``: the experts' outputs
    are not kept (``RuntimeTraits.moe_gate_in_activation``); ``fp8_linear``: the linear layers
    keep their inputs in FP8, one byte an element (``RuntimeTraits.fp8_linear``);
    ``memory_efficient_norm``: each norm keeps its output, which the matmul after it keeps
    anyway, instead of its input (``RuntimeTraits.memory_efficient_norm``)."""
    mode = mode or layout.activation_checkpointing
    t, h = layout.tp, model.dim
    sp = layout.sequence_parallel
    if mode == "full":
        return 2.0 / (t if sp else 1)
    q_ratio = model.n_heads * model.head_dim / h  # 1 unless model.head_width is set
    kv_ratio = model.kv_heads / model.n_heads * q_ratio
    if mode == "selective" and policy == "op" and not model.is_moe_layer(layer):
        # The block input (replicated unless sp), then the outputs of wq, wv, SDPA, w1, w2:
        # torchtitan's policy saves SDPA and every odd matmul (wq wk wv wo w1 w3 w2 in order).
        return (2.0 + 2.0) / (t if sp else 1) + (4.0 * q_ratio + 2.0 * kv_ratio
                                                 + 2.0 * model.ffn_dim / h) / t
    replicated = 8.0  # attention-norm input, qkv input, ffn-norm input, mlp input
    if memory_efficient_norm and not fp8_linear:
        # The norms' inputs are not kept: each norm's backward reads the output the next
        # matmul keeps. (Under FP8 the matmuls keep an FP8 copy, so the norm's own bf16 output
        # would be held beside it: nothing is saved.)
        replicated -= 4.0
    parallel = 4.0 * q_ratio + 4.0 * kv_ratio  # q, k, v, attention output (= wo input)
    if fp8_linear:
        # Transformer Engine's FP8 layers keep their inputs cast to FP8: the qkv and mlp inputs
        # (the norms' outputs) at one byte; the output projection an FP8 copy of the attention
        # output beside the one the fused attention keeps.
        replicated -= 2.0
        parallel += q_ratio
    if model.qk_norm:
        parallel += 2.0 * q_ratio + 2.0 * kv_ratio  # q and k before their norms
    if not flash and mode != "selective":
        parallel += 2.0 * model.n_heads * seq_len / h  # softmax probabilities
    # Saved per ffn/h: SwiGLU's gate and up outputs (4), the SiLU output and the product (2 each)
    # in eager PyTorch; a fused SwiGLU or selective recompute keeps the first two and the
    # product (6); GELU keeps its input and output (4).
    per_hidden = {("swiglu", "none"): 6.0 if fused_swiglu else 8.0,
                  ("swiglu", "selective"): 6.0}.get((model.mlp, mode), 4.0)
    if fp8_linear:
        per_hidden -= 1.0  # the down projection's input (the product, or GELU's output) in FP8
    whole = 0.0  # saved by every tp rank in full, with or without sequence parallelism
    if model.is_moe_layer(layer):
        k = model.moe_top_k
        f = model.expert_ffn_dim
        moe = 4.0 * model.moe_experts / h  # the router's fp32 scores
        outputs = 0.0 if moe_gate_in_activation else 2.0 * k  # kept for the gate's backward
        # The experts' input rows, kept for their weight gradients (in FP8 when the linear
        # layers run in FP8, as the dense layers' inputs are).
        inputs = (1.0 if fp8_linear else 2.0) * k
        if keeps_own_tokens(layout, moe_sequence_sharded):
            # Each tp rank routes its own S/tp tokens and nothing is gathered: the whole
            # layer's saved tensors are a tp-th (router, experts' inputs, intermediates and
            # outputs, shared experts).
            moe += (k * per_hidden * f / h + inputs + outputs
                    + per_hidden * model.shared_ffn_dim / h)
            return replicated / t + parallel / t + moe / t
        # meshtrain's replicated region: every tp rank routes the whole sequence (gathered
        # under sp). With experts folded over tp (ep > 1) each tp rank computes its 1/tp share
        # of the assignments: its experts' inputs and intermediates are that share, while the
        # expert outputs are all-gathered back whole for the gate-weighted sum
        # (parallel.expert.fold).
        split = row_split(layout)
        whole += k * per_hidden * f / h / split + per_hidden * model.shared_ffn_dim / h
        # The experts' input rows, their gathered outputs, the router's fp32 scores.
        whole += inputs / split + outputs + moe
        whole += 2.0 if sp else 0.0  # the gathered input (without sp: ``replicated`` has it)
    else:
        parallel += per_hidden * model.ffn_dim / h
    return replicated / (t if sp else 1) + parallel / t + whole


def layer_activation_bytes(workload: Workload, layout: Layout, layer: int,
                           mode: str | None = None, as_run: bool = True) -> float:
    """Bytes one block saves for backward for one micro-batch on one rank (its ``S / cp``
    tokens; the gathered K/V of context parallelism are counted apart). ``as_run=False``: as a
    runtime whose norms keep their inputs would save them, whatever the stack's
    ``memory_efficient_norm`` (the measure of the element-wise traffic, which the choice does not
    change)."""
    b = layout.micro_batch_size(workload.global_batch)
    units = layer_activation_units(workload.model, layer, workload.seq_len, layout,
                                   workload.traits.flash_attention, mode,
                                   workload.traits.selective_policy,
                                   workload.traits.fused_swiglu,
                                   workload.traits.moe_sequence_sharded,
                                   workload.traits.moe_gate_in_activation,
                                   workload.traits.fp8_linear,
                                   as_run and workload.traits.memory_efficient_norm)
    tokens = workload.seq_len / layout.cp * b
    return units * tokens * workload.model.dim * workload.act_bytes / 2


@dataclasses.dataclass
class RankMemory:
    """Memory of one rank of pipeline stage ``stage`` (every rank of a stage is alike)."""

    stage: int
    param_bytes: float
    grad_bytes: float
    optim_bytes: float
    activation_bytes: float
    buffer_bytes: float
    reserve_bytes: float = 0.0
    """What the caching allocator holds beyond the tensors alive at the peak (fragmentation):
    the profile's ``allocator_reserve`` fraction of the rest (0 on CPU profiles)."""

    @property
    def allocated_bytes(self) -> float:
        """The tensors alive at the peak: everything but the allocator's reserve."""
        return (self.param_bytes + self.grad_bytes + self.optim_bytes + self.activation_bytes
                + self.buffer_bytes)

    @property
    def total_bytes(self) -> float:
        """Everything together, the allocator's reserve included."""
        return self.allocated_bytes + self.reserve_bytes

    def to_dict(self) -> dict:
        """JSON form, bytes as integers."""
        return {"stage": self.stage, "param_bytes": int(self.param_bytes),
                "grad_bytes": int(self.grad_bytes), "optim_bytes": int(self.optim_bytes),
                "activation_bytes": int(self.activation_bytes),
                "buffer_bytes": int(self.buffer_bytes), "reserve_bytes": int(self.reserve_bytes),
                "total_bytes": int(self.total_bytes)}


def rank_memory(workload: Workload, layout: Layout, stage: int, layers: list[int],
                inflight: float, bucket_mb: float = 25.0,
                params: StageParams | None = None, reserve_fraction: float = 0.0) -> RankMemory:
    """Memory of a rank of pipeline ``stage`` holding ``layers`` with ``inflight``
    stage-microbatches of activations at its peak (``params``: the stage's
    :func:`stage_params`, when the caller has them; ``reserve_fraction``: the caching
    allocator's reserve over what is allocated, ``HardwareProfile.allocator_reserve``)."""
    model, lay = workload.model, layout
    first, last = stage == 0, stage == lay.pp - 1
    params = params or stage_params(model, layers, lay, first, last)
    grad_bytes = workload.traits.grad_reduce_bytes
    shards = lay.dp * lay.cp  # gradients reduce, and ZeRO shards, over dp × cp
    states = (workload.precision, grad_bytes, workload.traits.fp32_params,
              workload.traits.optimizer_state_bytes)
    dense = model_state_bytes(params.dense, lay.zero, shards, *states)
    expert_shards = expert_reduction_size(lay, workload.traits.moe_sequence_sharded)
    expert = model_state_bytes(params.expert, lay.zero, expert_shards, *states)
    param_b, grad_b, optim_b = (d + e for d, e in zip(dense, expert, strict=True))

    moe = model.moe_layer_count(layers)
    kinds = [(n, layer) for n, layer in ((len(layers) - moe, 0), (moe, model.first_moe_layer))
             if n]
    saved = {layer: layer_activation_bytes(workload, lay, layer) for _, layer in kinds}
    per_mb = sum(n * saved[layer] for n, layer in kinds)
    activations = per_mb * inflight + saved_kv_bytes(workload, lay, len(layers), inflight)
    b, s = lay.micro_batch_size(workload.global_batch), workload.seq_len / lay.cp
    if kinds:
        # Backward of a block holds the gradients of what it saved while it runs, beyond what
        # it saved (RuntimeTraits.backward_transient_blocks of a block). Under full
        # recomputation the block being recomputed is held whole (its backward frees its
        # activations as it makes their gradients: one block, not two).
        share = 1.0 if lay.activation_checkpointing == "full" else \
            workload.traits.backward_transient_blocks
        whole = saved if lay.activation_checkpointing == "none" else {
            layer: layer_activation_bytes(workload, lay, layer, "none") for _, layer in kinds}
        activations += share * max(whole.values())
    if last:  # logits and the loss's fp32 buffers, one micro-batch (loss_bytes_per_logit)
        logit = workload.traits.loss_bytes_per_logit + workload.act_bytes - 2  # fp32 logits
        if lay.pp > 1 and lay.pp_schedule == "gpipe":  # every loss's forward, then backwards
            logit += (inflight - 1) * (workload.traits.loss_saved_bytes_per_logit
                                       or workload.act_bytes)
        activations += logit * s * b * model.vocab_size / lay.tp
    if lay.zero >= 3:
        buffers = zero3_transient_bytes(workload, lay, layers, params.dense + params.expert,
                                        bucket_mb)
    else:
        buffers = sum(grad_reduce_transient_bytes(workload, lay.zero, n, count, bucket_mb)
                      for count, n in ((params.dense, shards), (params.expert, expert_shards)))
        if lay.zero == 0 and workload.traits.ddp_bucket_copy and shards > 1:
            buffers += (params.dense + params.expert) * grad_bytes
    if workload.traits.fp8_linear and lay.zero < 3:
        block = sum(sum(layer_params(model, layer, lay.tp, lay.ep)) for layer in layers)
        if workload.traits.fp8_params:
            # The block weights live in FP8 alone (fp8_param_gather): one byte a parameter.
            param_b -= (workload.act_bytes - 1) * block
        else:
            # The FP8 copy of each block weight, cast once a step and kept for every
            # micro-batch: one byte a parameter. A kept transpose beside it (another byte) would
            # put the FP8 train rows' published layout (Llama 3.1 8B, dgxc-benchmarking) over
            # the device memory, so it is not counted. Under ZeRO-3 the cast follows each
            # gather and is freed with it.
            buffers += block
    allocated = param_b + grad_b + optim_b + activations + buffers
    return RankMemory(stage, param_b, grad_b, optim_b, activations, buffers,
                      reserve_fraction * allocated)


def grad_reduce_transient_bytes(workload: Workload, zero: int, shards: int, params: float,
                                bucket_mb: float = 25.0) -> float:
    """What the gradient reduction of ``params`` parameters over ``shards`` ranks allocates
    beyond the model states at the end of backward, under ZeRO ``zero`` < 3, as the runtime
    does it (:class:`meshtrain.parallel.data.engine.DataParallelEngine`; the dry run counts the
    same, :func:`meshtrain.commands.dry_run.memory`):

    - ZeRO 0 all-reduces each bucket in place: nothing;
    - ZeRO 1 reduce-scatters each bucket into an output of its shard's size, and the outputs of
      every bucket stay alive until the last reduction is waited for: G P / N (Megatron-LM's
      distributed optimizer reduce-scatters into the gradient buffer itself: nothing,
      ``RuntimeTraits.zero1_reduce_in_place``);
    - ZeRO 2 reduces each bucket from the engine's staging pool
      (:data:`meshtrain.config.runtime_facts.INITIAL_PAIRS` pairs of a full bucket and its
      shard) into the gradient shard, and autograd's gradients of the bucket being filled live
      until its hook copies them in: (pairs x (1 + 1/N) + 1) buckets;
    - through the CPU shared-memory reducer (ZeRO 0-1), reductions are in place and instead
      (N-1)/N of the gradients, the peers' segments this rank sums, become resident.
    """

    if shards <= 1 or params <= 0:
        return 0.0
    gb = workload.traits.grad_reduce_bytes if workload.precision == "bf16" else 4
    grads = params * gb
    if zero <= 1 and workload.traits.shared_memory_reduce:
        return grads * (shards - 1) / shards
    if zero == 0 or (zero == 1 and workload.traits.zero1_reduce_in_place):
        return 0.0
    if zero == 1:
        return grads / shards
    bucket = min(bucket_mb * 2**20, grads)
    return (INITIAL_PAIRS * (1 + 1 / shards) + 1) * bucket


def zero3_units(model: ModelConfig, layer: int, tp: int, bucket_bytes: float,
                param_bytes: int) -> list[float]:
    """Parameters of each ZeRO-3 unit of block ``layer`` on one tp rank, in forward order, as
    the runtime splits it (:func:`meshtrain.parallel.data._zero3_units`): the whole block when
    it fits in ``bucket_bytes``, else its attention and MLP, each split into its projections
    when it does not fit either (the norm weights then join the root unit). A MoE block stays
    whole."""
    d = model.dim
    q, kv = d * model.n_heads * model.head_dim / tp, d * model.kv_heads * model.head_dim / tp
    attention = [q, kv, kv, q]
    if model.is_moe_layer(layer):
        return [sum(_layer_params(model, layer, tp, 1))]
    mlp = [d * model.ffn_dim / tp] * (3 if model.mlp == "swiglu" else 2)
    if (sum(attention) + sum(mlp) + 2 * d) * param_bytes <= bucket_bytes:
        return [sum(attention) + sum(mlp) + 2 * d]
    units: list[float] = []
    for part in (attention, mlp):
        units += [sum(part)] if sum(part) * param_bytes <= bucket_bytes else part
    return units


def zero3_transient_bytes(workload: Workload, layout: Layout, layers: list[int],
                          rank_params: float, bucket_mb: float = 25.0) -> float:
    """What a ZeRO-3 rank allocates beyond its model states at the peak of backward: the root
    unit (``rank_params`` minus the units: embedding, final norm, head and, when blocks are
    split, their norm weights), gathered from the logits' gradient to the end of backward; the
    unit being used and the ``RuntimeTraits.zero3_prefetch`` ones gathered ahead of it (the
    largest run of that many consecutive units); and the gradient
    staging buffers of the engine's pool (:data:`meshtrain.config.runtime_facts.INITIAL_PAIRS`,
    each sized for the largest bucket,
    the root's included: its gradients in full and its shard). With one unit per block
    (``RuntimeTraits.zero3_split_blocks`` False: FSDP2 as torchtitan runs it) there is no
    staging pool; the root's unsharded gradient is held instead."""

    model = workload.model
    pb = 2 if workload.precision == "bf16" else 4
    gb = workload.traits.grad_reduce_bytes if workload.precision == "bf16" else 4
    units = [u for layer in layers
             for u in zero3_units(model, layer, layout.tp, bucket_mb * 2**20, pb)]
    if not units:
        return 0.0
    root = max(rank_params - sum(units), 0.0)
    window = min(1 + workload.traits.zero3_prefetch, len(units))
    pairs = max(sum(units[i:i + window]) for i in range(len(units) - window + 1))
    if not workload.traits.zero3_split_blocks:
        # FSDP2 (one unit per block, torchtitan): no staging pool. At the peak (the start of
        # backward) the root is gathered and its head's gradient, unsharded in the parameter
        # dtype, lives until the root's reduce-scatter at the end of backward.
        return (2 * root + pairs) * pb
    staging = INITIAL_PAIRS * max(max(units), root) * gb * (1 + 1 / max(layout.dp, 1))
    return (root + pairs) * pb + staging


def zero_paper_model_states(params: float, zero: int, dp: int) -> float:
    """Model-state bytes per device from the ZeRO paper's closed forms (bf16/fp16 + Adam):
    16P, 4P + 12P/N, 2P + 14P/N, 16P/N."""
    return sum(model_state_bytes(params, zero, dp, "bf16", grad_bytes=2))
