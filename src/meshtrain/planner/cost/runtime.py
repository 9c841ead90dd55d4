"""What a training runtime does that changes time or memory, and the stacks priced with it.

:class:`RuntimeTraits` is one stack's behaviour (fused or eager kernels, what overlaps what,
what activation checkpointing keeps, how model states are held); :data:`STACKS` names the
presets ``estimate`` / ``plan --stack`` price. Each preset says what that stack could run at
the time its published runs were measured, feature by feature with the source, so
:func:`meshtrain.planner.cost.workload.check_stack_offers` refuses only what the stack could not
run. Kernel efficiencies per GPU generation are the stack's entries in
:mod:`meshtrain.planner.tables.stacks`, each fitted on named train rows.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config.layout import PP_SCHEDULES
from meshtrain.planner.hardware.stack_efficiency import StackEfficiency
from meshtrain.planner.tables.stacks import (
    MEGATRON_2021_A100,
    MEGATRON_CORE_2024_H100,
    MEGATRON_CORE_2025_H100,
    MEGATRON_DEEPSPEED_A100,
    TORCHTITAN_2024_A100,
    TORCHTITAN_2025_H100,
)


@dataclasses.dataclass(frozen=True)
class RuntimeTraits:
    """Behaviour of the training runtime that changes time or memory."""

    flash_attention: bool = True
    """Fused attention (SDPA / FlashAttention): no s×s scores in memory, causal half the work."""
    overlap_dp: bool = True
    """Gradient reduction (and ZeRO-3 gathers) overlap backward / forward compute, bucket by
    bucket (:mod:`meshtrain.planner.cost.overlap` says which micro-batches' compute hides them)."""
    dp_bucket_bytes: float = 25 * 2**20
    """Parameter bytes per data-parallel bucket (``parallel.dp_bucket_mb``, MiB; meshtrain's and
    PyTorch DDP's default 25): how many reductions a backward issues, the last one exposed."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages the runtime offers (what ``plan`` searches): Megatron-LM in 2021 had no
    distributed optimizer, only plain data parallelism."""
    context_parallel: bool = True
    """Whether the runtime offers context parallelism (Megatron-LM 2021 did not)."""
    pp_schedules: tuple[str, ...] = PP_SCHEDULES
    """Pipeline schedules the runtime offers (Megatron-LM 2021: 1F1B and interleaved 1F1B)."""
    sequence_parallel: bool = True
    """Whether the runtime offers sequence parallelism (Megatron-LM gained it with Korthikanti
    et al. 2022; the 2021 release of Narayanan et al. had none)."""
    checkpointing: tuple[str, ...] = ("none", "selective", "full")
    """Activation checkpointing modes the runtime offers (Megatron-LM 2021: none or full,
    ``--checkpoint-activations``; selective recompute is Korthikanti et al. 2022's)."""
    uniform_pipeline_stages: bool = False
    """Pipeline stages hold equal layer counts, as Megatron-LM requires: ``num_layers`` divisible
    by pp (``megatron/model/transformer.py``, "num_layers must be divisible by
    pipeline_model_parallel_size"), each stage's layers divisible by the virtual stages, and
    interleaving only with pp > 2 (``megatron/arguments.py``, "pipeline-model-parallel size
    should be greater than 2 with interleaved schedule"). False: meshtrain's cost-balanced
    split of any layer count."""
    zero3_split_blocks: bool = True
    """ZeRO-3 splits a block larger than a bucket into sub-module units (meshtrain); False: one
    unit per block (FSDP2 wrapping each block, as torchtitan does)."""
    zero3_prefetch: int = 1
    """ZeRO-3 units gathered ahead of the running one (``parallel.zero3_prefetch``; FSDP2's
    forward and backward prefetch of one)."""
    pp_scatter_gather: bool = False
    """Pipeline sends are split over the tp ranks (Narayanan et al. 2021, 4.1)."""
    pipeline_reduces_every_microbatch: bool = False
    """Under a pipeline, unsharded data parallelism reduces the gradients during every
    micro-batch's backward instead of only the last one's: Megatron-LM's pipeline schedules
    (``megatron/schedules.py``, ``forward_backward_pipelining_*``) never enter PyTorch DDP's
    ``no_sync``, which only its schedule without a pipeline uses. False: reduced once per step
    (meshtrain; Megatron-LM's local DDP all-reduces once, after the schedule)."""
    ddp_bucket_copy: bool = False
    """Unsharded data parallelism reduces through buckets that copy the gradients, a second
    gradient-sized buffer: PyTorch DDP without ``gradient_as_bucket_view``, as Megatron-LM
    wrapped it. False: gradients are reduced in place (meshtrain's flat buffers, Megatron-LM's
    local DDP)."""
    grad_reduce_bytes: int = 4
    """Bytes per gradient element, held and on the wire: meshtrain accumulates and reduces in
    fp32 (4) unless ``parallel.grad_reduce_dtype = bf16`` (2)."""
    elementwise_traffic: float = 8.0
    """HBM bytes element-wise kernels (norms, rotary, activation, residual) move in forward per
    byte of saved activations: about 3 with fused kernels, more in eager PyTorch."""
    shared_memory_reduce: bool = False
    """ZeRO 0-1 gradients reduce through meshtrain's CPU shared-memory reducer (all dp ranks on
    one host, ``parallel.dp_shared_memory``): in place, but each rank reads its segment of every
    peer's gradient buffer, so (N-1)/N of its stage's gradients become resident in its address
    space (the kernel counts those shared pages in every reader's VmHWM)."""
    optimizer_bytes_per_param: float = 44.0
    """Memory traffic of the gradient clipping + AdamW update + zero_grad per parameter (shard).
    meshtrain in fp32: the clip's norm (4) and scale (8), PyTorch's fused AdamW kernel reading
    master, gradient, m and v and writing master, m and v (28), zeroing (4). (The eager formula
    it replaced made about a dozen passes, 96.) A fused Adam (Megatron-LM / Apex) reads master,
    m, v, grad and writes master, m, v and the bf16 copy: 30."""
    selective_policy: str = "modules"
    """What ``selective`` checkpointing recomputes. ``modules``: meshtrain's (the attention core
    and the MLP activation function, :mod:`meshtrain.parallel.activation_checkpoint`; for an
    unfused-attention runtime like Megatron-LM this is Korthikanti et al. 2022's selective
    recompute, which drops the ``5as/h`` term). ``op``: torchtitan's per-op policy
    (``torchtitan/models/llama3/infra/parallelize.py``, ``_save_list``): the whole block is
    checkpointed and only the outputs of SDPA and of every other matmul (wq, wv, w1, w2) are
    kept."""
    kernel_efficiency: tuple[tuple[str, StackEfficiency], ...] = ()
    """The stack's kernel figures by GPU generation, ``(profile family, figures)`` pairs; on a
    profile whose family has no entry, the profile's own (:mod:`meshtrain.planner.
    stack_efficiency`, where each entry states its source)."""
    loss_bytes_per_logit: float = 6.0
    """Bytes per logit element alive at the start of backward on the last stage. 6: the
    activation-dtype logits and one fp32 copy (meshtrain; Megatron-LM's vocab-parallel
    cross-entropy, which keeps the fp32 softmax it computes in place for backward). An eager
    ``F.cross_entropy(logits.float())`` as torchtitan runs it keeps the saved fp32 log-softmax
    output while its backward allocates the fp32 gradients of both the log-softmax output and
    input: 12."""
    loss_saved_bytes_per_logit: float = 0.0
    """Bytes per logit element a micro-batch's loss keeps from its forward to its backward: what
    a last stage holds for each further micro-batch in flight (GPipe runs every forward before
    the first backward; the 1F1B family runs each last-stage backward right after its forward).
    0: the activation dtype's size, the logits meshtrain's chunked cross-entropy keeps
    (:mod:`meshtrain.training.cross_entropy`); 4: the fp32 log-softmax output of torchtitan's
    eager ``F.cross_entropy(logits.float())``."""
    fused_swiglu: bool = False
    """SwiGLU's activation is one fused kernel that saves only its input (the gate and up
    projections' output) and recomputes the SiLU in backward: Megatron-LM's ``bias_swiglu_impl``
    (``megatron/core/fusions/fused_bias_swiglu.py``), NeMo's ``fast-swiglu`` with
    ``bias_activation_fusion``. A block then saves ``6 f/h`` units for its MLP instead of eager
    PyTorch's ``8 f/h`` (gate and up outputs, the SiLU output, their product)."""
    backward_transient_blocks: float = 0.4
    """What a block's backward holds at its peak beyond the activations it saved (the gradients
    of its largest intermediates while it makes them), as a fraction of one block's saved
    activations; full recomputation holds the recomputed block whole instead. meshtrain: 0.4,
    measured from outside on the CPU, where its norms keep only their input as the fused norms
    of GPU runtimes do (docs/planner.md, *Activation memory measured from outside*: the VmHWM
    difference of a long and a short sequence; the estimate is 0.87-1.10 of it across the
    cases). The published stacks: 1, the figure their memory rows were fitted with (the
    allocator reserve was fitted beside it on torchtitan's FSDP row, and no GPU measurement
    here separates the two)."""
    fp8_linear: bool = False
    """The blocks' linear layers run their GEMMs in FP8 (Transformer Engine's FP8 recipe, as
    NeMo's ``fp8: true`` and torchtitan's Float8 run them), at the stack's FP8 efficiency of the
    profile's FP8 peak (``StackEfficiency.fp8_gemm``); attention, the LM head and every
    collective stay in the activation dtype; each GEMM also pays the casts of its input and of
    its output gradient to FP8. Memory: the linear layers keep their inputs in FP8, and each rank
    keeps an FP8 copy of its block weights for the step (1 byte a parameter, under ``buffers``;
    not under ZeRO-3). A run setting (``--trait fp8_linear=true``): no stack preset sets it."""
    fp8_params: bool = False
    """With ``fp8_linear``: the block weights are held in FP8 only (Megatron-Core's
    ``fp8_param_gather``, which Megatron-Bridge's FP8 recipes set; Transformer Engine's
    ``fp8_model_init``): one byte a parameter instead of the activation dtype's, and no FP8 copy
    beside them; the fp32 master weights stay in the optimizer state. Under ZeRO-3 it changes
    nothing priced. A run setting (``--trait fp8_params=true``)."""
    memory_efficient_norm: bool = False
    """Each RMSNorm keeps its output for backward instead of its input (the normalised input
    is the output over the norm's weight): apex's ``FusedRMSNorm(memory_efficient=True)``,
    Megatron-LM's ``--memory-efficient-layer-norm``. The output is what the next matmul keeps
    for its weight gradient anyway, so a block keeps neither norm's input: ``4 / tp`` units
    (sequence parallel; ``4`` without) less a block and micro-batch. Under ``fp8_linear`` it saves
    nothing (the matmuls keep an FP8 copy beside the norm's output). False: a norm keeps its
    input (meshtrain, PyTorch, Transformer Engine's fused norm-and-linear). Time is priced the
    same either way."""
    fp32_params: bool = False
    """Sharded parameters are held in fp32 and only gathered in the training dtype (FSDP2 with a
    bf16 ``MixedPrecisionPolicy``, as torchtitan runs it): bf16 model states are ``4 + G + 8``
    bytes per parameter (fp32 parameter, gradient, Adam's two moments), not ``2 + G + 12``."""
    tp_comm_overlap: bool = False
    """Tensor-parallel collectives are pipelined with the GEMMs they feed or follow
    (Transformer Engine's userbuffers, Megatron-LM ``--tp-comm-overlap``; torchtitan's async
    tensor parallelism): each collective goes in ``tp`` ring steps, the first exposed and the
    rest hidden behind the block's GEMMs, up to their time (:mod:`meshtrain.planner.cost.
    overlap`)."""
    pp_comm_overlap: bool = False
    """Pipeline sends and receives of the interleaved schedule are posted a chunk ahead and
    overlap that chunk's compute (Megatron-LM ``overlap_p2p_comm``): only what outlasts one
    chunk's forward or backward is exposed."""
    cp_comm_overlap: bool = False
    """Context-parallel key/value exchange runs as a ring whose steps hide behind the attention
    of the chunk already held (Megatron-Core / Transformer Engine context parallelism): only
    what outlasts the layer's attention compute is exposed."""
    optimizer_state_bytes: float = 12.0
    """A bf16 model's optimizer state per parameter: the fp32 master copy and Adam's two fp32
    moments (12); 6 when a run keeps them in bf16 (NeMo's ``optim.dtype: bf16``)."""
    zero1_reduce_in_place: bool = False
    """ZeRO-1 reduce-scatters each bucket into the rank's own slice of the gradient buffer
    (Megatron-LM's distributed optimizer, ``megatron/core/distributed``), so no reduction
    output is allocated beside it; False: meshtrain's engine, whose outputs of every bucket
    stay alive until the last is waited for."""
    param_gather_overlap: bool = False
    """The distributed optimizer's parameter all-gather after the update (ZeRO 1-2) overlaps the
    next step's forward, bucket by bucket (Megatron-LM ``--overlap-param-gather``); else it is
    exposed."""
    moe_sequence_sharded: bool = False
    """Under sequence parallelism each tp rank keeps its own ``S / tp`` tokens through an MoE
    layer: it routes them and dispatches their assignments over an expert group that spans the
    tp ranks, and nothing is gathered over tp (Megatron-Core's MoE with expert tensor
    parallelism 1). False: meshtrain's replicated region, where every tp rank routes the whole
    gathered sequence and folded experts all-gather their outputs back
    (:mod:`meshtrain.planner.cost.expert_parallel`)."""
    moe_gate_in_activation: bool = False
    """The router's gate weights multiply the experts' SwiGLU output inside the activation
    kernel (Megatron-Core's weighted SwiGLU), so the experts' outputs are not kept for the
    gate's backward and the unpermute is a plain sum; False: the outputs are kept, as
    meshtrain's gate-weighted sum keeps them."""
    ep_comm_overlap: bool = False
    """The expert all-to-alls of one micro-batch run while another micro-batch computes
    (Megatron-Core's ``overlap_moe_expert_parallel_comm``, pairing one micro-batch's forward
    with another's backward): each of an MoE block's four all-to-alls runs beside one compute
    module of the other micro-batch (attention or experts, forward or backward) and only what
    outlasts that module is exposed (:func:`meshtrain.planner.cost.overlap.paired_exposed`)."""
    pp_early_grad_sends: bool = True
    """Under 1F1B every rank but the first runs the backwards its predecessor waits for in the
    cool-down as input gradient, send, then weight gradient (meshtrain's
    :mod:`meshtrain.parallel.pipeline.schedules`), which takes one weight-gradient pass off
    each of the ``pp - 1`` hand-overs; False: the paper's whole backwards (Megatron-LM,
    torchtitan's ``Schedule1F1B``)."""
    offload: bool = True
    """The runtime keeps a ZeRO shard in host memory or NVMe files as meshtrain does
    (``parallel.offload``, :mod:`meshtrain.planner.cost.offload`); the published stacks are
    priced without it."""


MESHTRAIN = RuntimeTraits()
"""meshtrain itself. No kernel-efficiency entries: there is no published meshtrain GPU run to fit
on, so every GPU profile's own figures apply (and a calibrated profile's measured ones)."""
MEGATRON_2021 = RuntimeTraits(flash_attention=False, overlap_dp=False, pp_scatter_gather=True,
                              pp_early_grad_sends=False,
                              backward_transient_blocks=1.0, grad_reduce_bytes=4,
                              elementwise_traffic=3.0,
                              optimizer_bytes_per_param=30.0, zero_stages=(0,),
                              context_parallel=False,
                              pp_schedules=("1f1b", "interleaved-1f1b"),
                              sequence_parallel=False, checkpointing=("none", "full"),
                              uniform_pipeline_stages=True, offload=False,
                              kernel_efficiency=(("a100", MEGATRON_2021_A100),))
"""Megatron-LM as Narayanan et al. 2021 ran it (SC21): unfused attention, no overlap of the
data-parallel all-reduce, scatter/gather pipeline sends, no sequence parallelism, full
recompute only, equal layer counts per stage; its A100 GEMM efficiency fitted on Narayanan's
Table 1 (no H100 entry: the stack predates the H100, which falls back to the profile)."""
MEGATRON_2021_TORCH_DDP = dataclasses.replace(MEGATRON_2021, overlap_dp=True, grad_reduce_bytes=2,
                                              pipeline_reduces_every_microbatch=True,
                                              ddp_bucket_copy=True)
"""Megatron-LM 2021 with ``--DDP-impl torch`` (PyTorch DistributedDataParallel), as its SC21
reproduction script ran Table 1's models without a pipeline (``examples/sc21/run_table_1.sh``,
``DDP=torch``): DDP's 25 MB buckets all-reduce during the last micro-batch's backward (the others
run under ``no_sync``, ``megatron/schedules.py``; with a pipeline, whose schedules do not use
``no_sync``, during every micro-batch's backward) through its own copy of the gradients, in
the fp16 parameters' dtype: bf16 turns on
fp32 gradient accumulation, which ``megatron/arguments.py`` allows with local DDP only ("If we
do accumulation and all-reduces in fp32, we need to have local DDP")."""
MEGATRON_2022 = dataclasses.replace(MEGATRON_2021, sequence_parallel=True, zero_stages=(0, 1),
                                    checkpointing=("none", "selective", "full"),
                                    zero1_reduce_in_place=True)
"""Megatron-LM in 2022: the 2021 stack plus Korthikanti et al. 2022's sequence parallelism and
selective recompute, and the distributed optimizer (``--use-distributed-optimizer``,
Megatron-LM ``docs/distrib_optimizer.md``: ZeRO-1, the fp32 gradients reduce-scattered and the
updated parameters all-gathered, not overlapped). Same code base and cluster (Selene's A100),
no fit rows of its own: it keeps the 2021 stack's A100 kernel efficiency."""
MEGATRON_DEEPSPEED = dataclasses.replace(
    MEGATRON_2021, zero_stages=(0, 1), pp_schedules=("1f1b",), pp_scatter_gather=False,
    uniform_pipeline_stages=False, kernel_efficiency=(("a100", MEGATRON_DEEPSPEED_A100),))
"""Megatron-DeepSpeed as BLOOM (BigScience 2022) and MT-NLG (Smith et al. 2022) ran it:
Megatron-LM's model code and fused kernels (unfused softmax attention, tp without sequence
parallelism, full recompute) under DeepSpeed's pipeline engine (1F1B only, each tp rank sends
the whole boundary activation, layers split as evenly as the count allows) and DeepSpeed's
ZeRO-1 over data parallelism, reduced after the pipeline, not overlapped. Its A100 efficiency is
fitted on MT-NLG's smallest run (:data:`meshtrain.planner.tables.stacks.MEGATRON_DEEPSPEED_A100`:
lower than megatron-2021's for the same kernels, the engine's unpriced cost folded in)."""
MEGATRON_CORE_2024 = RuntimeTraits(
    pp_early_grad_sends=False,
    backward_transient_blocks=1.0,
    flash_attention=True, overlap_dp=True, zero_stages=(0, 1), context_parallel=True,
    pp_schedules=("1f1b", "interleaved-1f1b"), sequence_parallel=True,
    checkpointing=("none", "selective", "full"), uniform_pipeline_stages=True,
    grad_reduce_bytes=4, elementwise_traffic=3.0, optimizer_bytes_per_param=30.0,
    fused_swiglu=True, tp_comm_overlap=True, pp_comm_overlap=True, cp_comm_overlap=True,
    param_gather_overlap=True, zero1_reduce_in_place=True, offload=False,
    kernel_efficiency=(("h100", MEGATRON_CORE_2024_H100),))
"""Megatron-Core as NeMo 24.09 ran it on H100 (NVIDIA dgxc-benchmarking recipes, NeMo-Framework-
Launcher ``conf/training/llama/llama3_1_405b.yaml``): Transformer Engine kernels (fused
attention, layer-norm fused into the linear layers, fused rotary, ``fast-swiglu`` with
``bias_activation_fusion``), the distributed optimizer with ``overlap_grad_sync`` and
``overlap_param_sync`` (ZeRO-1, fp32 gradients), ``ub_tp_comm_overlap``, ``overlap_p2p_comm``,
sequence parallelism, context parallelism, interleaved 1F1B with equal layers per virtual
stage, selective (core attention) or full recompute; its H100 GEMM efficiency is fitted on its
train rows (:data:`meshtrain.planner.tables.stacks.MEGATRON_CORE_2024_H100`)."""
LLAMA3_2024 = dataclasses.replace(
    MEGATRON_CORE_2024, zero_stages=(0, 2, 3), uniform_pipeline_stages=False,
    cp_comm_overlap=False, zero3_split_blocks=False, memory_efficient_norm=True)
"""Meta's training runtime as Llama Team 2024 ("The Llama 3 Herd of Models", arXiv:2407.21783,
3.3.2) describes it for Llama 3 405B on H100: FSDP that shards the optimizer state and the
gradients but keeps the weights gathered from forward through backward (ZeRO-2; with a
pipeline, each micro-batch's gradients are reduce-scattered in fp32 into the fp32 shard, the
paper's "FP32 gradient accumulation ... and reduce-scatter gradients in FP32"); an interleaved
pipeline whose first and last stages hold one layer fewer (the first chunk only the embedding,
the last only the head: unequal stages), with asynchronous sends; context parallelism that
all-gathers K and V before attention (not a ring, so not hidden behind it); tensor
parallelism; the input and output tensors of every pipeline stage freed as soon as no later
computation needs them. With one layer a chunk a stage's input is its block's input, which the
block's first norm would keep for backward if it kept its input: freeing it saves memory only
if the norms keep their outputs instead, so the blocks are priced with ``memory_efficient_norm``
(both norms of a block alike). What the paper does not state (sequence parallelism, fused
kernels and SwiGLU, flash attention, tensor-parallel communication overlap, the optimizer's
traffic, the kernels' efficiency) is priced as ``megatron-core-2024``, the H100 stack of the
same year, with that stack's H100 fit: nothing is fitted on Meta's runs, which stay test rows.
Its pipeline order is Megatron's (the paper's tunable number of consecutive micro-batches
``N`` priced at ``N = pp``, Megatron-Core's default)."""
TORCHTITAN_2024 = RuntimeTraits(selective_policy="op", loss_bytes_per_logit=12.0,
                                pp_early_grad_sends=False,
                                backward_transient_blocks=1.0, loss_saved_bytes_per_logit=4.0,
                                zero3_split_blocks=False,
                                fp32_params=True, offload=False,
                                kernel_efficiency=(("a100", TORCHTITAN_2024_A100),))
"""torchtitan (PyTorch-native, FSDP2) as its docs/performance.md was measured: SDPA, FSDP2
overlapped reduce-scatter in fp32 with fp32 sharded parameters, eager element-wise kernels,
per-op selective checkpointing, eager fp32 cross-entropy; its A100 GEMM efficiency fitted on
its Llama 2 13B A100 row (no H100 entry: its H100 rows without torch.compile are test rows, so
H100 profiles use their own figure)."""
TORCHTITAN_2025 = dataclasses.replace(
    TORCHTITAN_2024, elementwise_traffic=3.0, tp_comm_overlap=True,
    pp_schedules=("gpipe", "1f1b", "interleaved-1f1b"),
    kernel_efficiency=(("a100", TORCHTITAN_2024_A100), ("h100", TORCHTITAN_2025_H100)))
"""torchtitan as of its December 2024 performance runs (torch and torchtitan of 2024-12-26,
docs/performance.md): the 2024 stack with ``torch.compile`` on every block (element-wise
kernels fused), async tensor parallelism (which needs compile), and pipeline schedules; its
Float8 runs are priced with ``fp8_linear`` (a run setting). Its H100 GEMM efficiency is fitted on
its 8-GPU Table 1 compile row (:data:`meshtrain.planner.tables.stacks.TORCHTITAN_2025_H100`)."""
MEGATRON_CORE_2025 = dataclasses.replace(MEGATRON_CORE_2024, moe_sequence_sharded=True,
                                         moe_gate_in_activation=True,
                                         uniform_pipeline_stages=False, grad_reduce_bytes=2,
                                         kernel_efficiency=(("h100", MEGATRON_CORE_2025_H100),))
"""Megatron-Core as Megatron-Bridge's 2025 performance recipes run it (``scripts/performance``):
the 2024 stack, with bf16 gradient reduction (each model's common settings set
``grad_reduce_in_fp32 = False``), uneven pipeline stages (``pipeline_model_parallel_layout``,
the embedding and the loss counted as layers), the MoE layer of expert tensor parallelism 1
(each tp rank's own tokens dispatched by all-to-all over an expert group spanning the tp ranks,
nothing gathered over tp) and the router's gate weights applied inside the experts' SwiGLU
(``weighted_bias_swiglu``). Its recipes differ on overlapping the expert all-to-alls with
another micro-batch's compute (``moe_a2a_overlap``: on for Qwen3-235B on H100, off for
Qwen3-30B): the stack prices them exposed, and a run that overlaps them sets
``ep_comm_overlap`` (the Qwen3-235B rows). Its H100 entry keeps the 2024 stack's GEMM figures
and adds the per-expert overhead fitted on its Qwen3-30B-A3B train row
(:data:`meshtrain.planner.tables.stacks.MEGATRON_CORE_2025_H100`)."""
AUTOMODEL_2026 = dataclasses.replace(
    TORCHTITAN_2025, fp32_params=False, optimizer_state_bytes=8.0, moe_gate_in_activation=True,
    tp_comm_overlap=False)
"""NeMo AutoModel (PyTorch-native: FSDP2, Transformer Engine layers, DeepEP) as its 2026
performance summary's benchmark recipes run it (``examples/llm_benchmark``): FSDP2 over
parameters held in bf16 (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` around a
model built in bf16, so no fp32 master copy), Transformer Engine's ``FusedAdam`` with its
default fp32 moments (8 bytes a parameter; a run whose ``torch.optim.Adam`` keeps bf16 moments
sets ``optimizer_state_bytes=4``), ``MaskedCrossEntropy`` on the whole logits upcast to fp32
(torchtitan's eager loss; without the upcast about half: ``loss_bytes_per_logit=6``), fused
element-wise kernels (TE norms and rotary, or ``torch.compile``), the experts a grouped GEMM with
the gate weights inside their SwiGLU, dispatched by DeepEP and not overlapped. Asynchronous
tensor parallelism is off in its recipes. Everything else, and its kernels' H100 efficiency, is
``torchtitan-2025``'s (the PyTorch-native FSDP2 stack it shares its kernels with): no row of its
own is fitted, and its published rows are test rows. No per-expert overhead is priced."""
STACKS = {"meshtrain": MESHTRAIN, "megatron-2021": MEGATRON_2021,
          "megatron-2021-torch-ddp": MEGATRON_2021_TORCH_DDP, "megatron-2022": MEGATRON_2022,
          "megatron-deepspeed": MEGATRON_DEEPSPEED, "megatron-core-2024": MEGATRON_CORE_2024,
          "megatron-core-2025": MEGATRON_CORE_2025, "llama3-2024": LLAMA3_2024,
          "torchtitan-2024": TORCHTITAN_2024, "torchtitan-2025": TORCHTITAN_2025,
          "automodel-2026": AUTOMODEL_2026}
"""Software stacks the cost model can price, by name."""

