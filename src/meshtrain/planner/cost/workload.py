"""What the cost model prices: a workload (model, batch, runtime traits) and a layout.

:class:`Workload` is the model shape with the step's batch and precision; :class:`RuntimeTraits`
says what the training runtime does (fused attention, overlapped gradient reduction, ...), so the
same cost model prices meshtrain and, for validation against published numbers, Megatron-LM as it
ran in 2021. A candidate is a :class:`~meshtrain.config.layout.Layout` (parallel degrees and
schedule, the same class a run config's ``[parallel]`` section is); :func:`check_layout` refuses a
layout the shapes cannot take, with a message naming what would work.
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import Config, ConfigError, ModelConfig
from meshtrain.config import layout_rules as rules
from meshtrain.config.layout import PP_SCHEDULES, Layout
from meshtrain.config.layout_rules import (
    check_expert_degree,
    check_global_batch,
    check_interleaved_microbatches,
    check_pipeline_stages,
    check_sequence_parallel,
    check_tensor_parallel,
    check_zero_stage,
    choice,
)
from meshtrain.planner.hardware.stack_efficiency import StackEfficiency
from meshtrain.planner.tables.stacks import MEGATRON_2021_A100, TORCHTITAN_2024_A100


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
    activation-dtype logits and one fp32 copy. An eager ``F.cross_entropy(logits.float())``
    as torchtitan runs it keeps the saved fp32 log-softmax output while its backward allocates
    the fp32 gradients of both the log-softmax output and input: 12."""


MESHTRAIN = RuntimeTraits()
"""meshtrain itself. No kernel-efficiency entries: there is no published meshtrain GPU run to fit
on, so every GPU profile's own figures apply (and a calibrated profile's measured ones)."""
MEGATRON_2021 = RuntimeTraits(flash_attention=False, overlap_dp=False, pp_scatter_gather=True,
                              grad_reduce_bytes=4, elementwise_traffic=3.0,
                              optimizer_bytes_per_param=30.0, zero_stages=(0,),
                              context_parallel=False,
                              pp_schedules=("1f1b", "interleaved-1f1b"),
                              sequence_parallel=False, checkpointing=("none", "full"),
                              uniform_pipeline_stages=True,
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
MEGATRON_2022 = dataclasses.replace(MEGATRON_2021, sequence_parallel=True,
                                    checkpointing=("none", "selective", "full"))
"""Megatron-LM as Korthikanti et al. 2022 ran it: the 2021 stack plus sequence parallelism and
selective recompute (the paper's two contributions). Same code base and cluster (Selene's
A100), no fit rows of its own: it keeps the 2021 stack's A100 kernel efficiency."""
TORCHTITAN_2024 = RuntimeTraits(selective_policy="op", loss_bytes_per_logit=12.0,
                                zero3_split_blocks=False,
                                kernel_efficiency=(("a100", TORCHTITAN_2024_A100),))
"""torchtitan (PyTorch-native, FSDP2) as its docs/performance.md was measured: SDPA, FSDP2
overlapped reduce-scatter in fp32, eager element-wise kernels, per-op selective checkpointing,
eager fp32 cross-entropy; its A100 GEMM efficiency fitted on its Llama 2 13B A100 row (no H100
entry: its one H100 throughput row is a report row, so H100 profiles use their own figure)."""
STACKS = {"meshtrain": MESHTRAIN, "megatron-2021": MEGATRON_2021,
          "megatron-2021-torch-ddp": MEGATRON_2021_TORCH_DDP, "megatron-2022": MEGATRON_2022,
          "torchtitan-2024": TORCHTITAN_2024}
"""Software stacks the cost model can price, by name."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """The model and one optimizer step's batch."""

    model: ModelConfig
    seq_len: int
    global_batch: int
    """Sequences per optimizer step."""
    precision: str = "bf16"
    traits: RuntimeTraits = MESHTRAIN

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element."""
        return 2 if self.precision == "bf16" else 4

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step."""
        return self.seq_len * self.global_batch

    @classmethod
    def from_config(cls, config: Config, traits: RuntimeTraits = MESHTRAIN) -> Workload:
        """The workload a run config describes."""
        traits = dataclasses.replace(traits,
                                     dp_bucket_bytes=config.parallel.dp_bucket_mb * 2**20)
        if config.parallel.grad_reduce_dtype == "bf16":
            traits = dataclasses.replace(traits, grad_reduce_bytes=2)
        if (config.train.device == "cpu" and config.parallel.dp_shared_memory
                and config.train.precision == "fp32"):  # the reducer takes fp32 buckets only
            traits = dataclasses.replace(traits, shared_memory_reduce=True)
        return cls(config.model, config.train.seq_len, config.train.global_batch,
                   config.train.precision, traits)


LAYOUT_JSON_FIELDS = ("dp", "tp", "pp", "cp", "ep", "zero", "sequence_parallel", "schedule",
                      "virtual_stages", "microbatches", "activation_checkpointing")
"""The keys of an estimate's ``layout`` (``meshtrain estimate --json``): the
:class:`~meshtrain.config.layout.Layout` fields the cost model prices, ``schedule`` being
``pp_schedule``. ``pp_split`` is priced (:func:`stage_layers`) but not listed."""


def layout_to_json(layout: Layout) -> dict:
    """The JSON form of ``layout`` in an estimate (keys :data:`LAYOUT_JSON_FIELDS`)."""
    values = dataclasses.asdict(layout.layout())
    values["schedule"] = values.pop("pp_schedule")
    return {key: values[key] for key in LAYOUT_JSON_FIELDS}


def layout_from_json(data: dict) -> Layout:
    """The :class:`~meshtrain.config.layout.Layout` an estimate's ``layout`` dict describes."""
    values = {key: data[key] for key in LAYOUT_JSON_FIELDS if key != "cp"}
    values["cp"] = data.get("cp", 1)
    values["pp_schedule"] = values.pop("schedule")
    return Layout(**values)


def stage_layers(model: ModelConfig, layout: Layout) -> list[list[int]]:
    """Layer ids each pipeline rank holds, exactly as the runtime places them: the layers split
    into ``pp × chunks`` stages by :func:`meshtrain.parallel.pipeline.stage_split.stage_layers`
    (balanced by cost, or ``pp_split``), each stage on the rank the schedule's placement gives
    it (round robin; a V for zb-v)."""
    if layout.pp == 1:
        return [list(range(model.n_layers))]
    return [list(layers) for layers in _stage_layers(
        repr(model), layout.pp, layout.chunks_per_rank, layout.pp_schedule == "zb-v",
        layout.pp_split, model)]


def stack_split(workload: Workload, layout: Layout) -> Layout:
    """``layout`` with the layer split the priced runtime makes: with
    ``RuntimeTraits.uniform_pipeline_stages`` and no ``pp_split`` of its own, equal layer counts
    per stage (Megatron-LM: the embedding and the LM head ride on the first and last stages on
    top of their layers); otherwise unchanged (meshtrain balances stages by cost)."""
    stages = layout.pp * layout.chunks_per_rank
    if layout.pp == 1 or layout.pp_split or not workload.traits.uniform_pipeline_stages:
        return layout
    n = workload.model.n_layers
    counts = [n // stages + (1 if i < n % stages else 0) for i in range(stages)]
    return dataclasses.replace(layout, pp_split=",".join(map(str, counts)))


_SPLITS: dict[tuple, tuple[tuple[int, ...], ...]] = {}


def _stage_layers(key: str, pp: int, chunks: int, v_shape: bool, split: str,
                  model: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """:func:`stage_layers`, remembered per (model, pp, chunks, placement, split): the planner
    prices the same few splits for many candidates."""
    cache_key = (key, pp, chunks, v_shape, split)
    if cache_key not in _SPLITS:
        from meshtrain.parallel.pipeline.schedule import standard_placement, v_placement
        from meshtrain.parallel.pipeline.stage_split import stage_layers as runtime_stage_layers

        placement = v_placement(pp) if v_shape else standard_placement(pp, chunks)
        ranks: list[list[int]] = [[] for _ in range(pp)]
        per_stage = runtime_stage_layers(model, model.vocab_size, pp * chunks, split)
        for stage, layers in enumerate(per_stage):
            ranks[placement[stage]].extend(layers)
        _SPLITS[cache_key] = tuple(tuple(sorted(layers)) for layers in ranks)
    return _SPLITS[cache_key]


def check_layout(workload: Workload, layout: Layout) -> None:
    """Raise :class:`ConfigError` when ``layout`` cannot run ``workload``."""
    m, lay = workload.model, layout
    for key in ("dp", "tp", "pp", "cp", "ep", "virtual_stages", "microbatches"):
        if getattr(lay, key) < 1:
            raise ConfigError(f"parallel.{key} = {getattr(lay, key)} must be at least 1.")
    choice(lay.pp_schedule, PP_SCHEDULES, "parallel.pp_schedule")
    check_zero_stage(lay.zero)
    check_tensor_parallel(lay.tp, n_heads=m.n_heads, kv_heads=m.kv_heads, ffn_dim=m.ffn_dim,
                          expert_ffn_dim=m.expert_ffn_dim if m.moe_experts else None,
                          seq_len=workload.seq_len if lay.sequence_parallel else None)
    check_sequence_parallel(lay.sequence_parallel, lay.tp)
    check_pipeline_stages(lay.pp * lay.chunks_per_rank, m.n_layers)
    if lay.pp_schedule == "interleaved-1f1b" and lay.pp > 1:
        check_interleaved_microbatches(lay.pp, lay.microbatches)
    if lay.ep > 1:
        check_expert_degree(lay.ep, lay.dp, lay.tp, m.moe_experts)
    check_global_batch(workload.global_batch, lay.dp, lay.microbatches)
    if lay.cp > 1:
        check_context_parallel(workload, lay)


def check_stack_offers(workload: Workload, layout: Layout, stack: str) -> None:
    """Raise :class:`ConfigError` when ``layout`` uses what the runtime ``stack`` (a
    :data:`STACKS` name, ``workload.traits``) does not offer, naming what it does. Every
    layout ``plan`` searches for that stack passes."""
    traits, lay, n_layers = workload.traits, layout, workload.model.n_layers
    problems = []
    if lay.zero not in traits.zero_stages:
        problems.append(f"parallel.zero = {lay.zero} (ZeRO stages it offers: "
                        f"{', '.join(map(str, traits.zero_stages))})")
    if lay.cp > 1 and not traits.context_parallel:
        problems.append(f"parallel.cp = {lay.cp} (it has no context parallelism: cp = 1)")
    if lay.sequence_parallel and not traits.sequence_parallel:
        problems.append("parallel.sequence_parallel = true (it has no sequence parallelism)")
    if lay.activation_checkpointing not in traits.checkpointing:
        problems.append(f'parallel.activation_checkpointing = "{lay.activation_checkpointing}" '
                        f"(it offers {', '.join(traits.checkpointing)})")
    if lay.pp > 1 and lay.pp_schedule not in traits.pp_schedules:
        problems.append(f'parallel.pp_schedule = "{lay.pp_schedule}" '
                        f"(it offers {', '.join(traits.pp_schedules)})")
    if traits.uniform_pipeline_stages and lay.pp > 1 and not lay.pp_split:
        stages = lay.pp * lay.chunks_per_rank
        if n_layers % stages:
            problems.append(f"pp × chunks per rank = {stages} stages for {n_layers} layers (it "
                            "gives every stage as many layers: the stages must divide the "
                            "layer count)")
        if lay.pp_schedule == "interleaved-1f1b" and lay.chunks_per_rank > 1 and lay.pp <= 2:
            problems.append(f"interleaved-1f1b with parallel.pp = {lay.pp} (it interleaves "
                            "only with pp > 2)")
    if problems:
        raise ConfigError(f"--stack {stack} cannot run this layout: " + "; ".join(problems)
                          + ".")


def check_context_parallel(workload: Workload, layout: Layout) -> None:
    """Raise :class:`ConfigError` (naming the valid degrees) when ``layout.cp`` cannot split
    ``workload``'s sequences: the runtime's own rule,
    :func:`meshtrain.config.layout_rules.check_context_parallel`."""
    rules.check_context_parallel(workload.seq_len, layout.cp,
                                 layout.tp if layout.sequence_parallel else 1, workload.model)


def context_parallel_fits(workload: Workload, cp: int, tp: int, sequence_parallel: bool) -> bool:
    """Whether ``cp`` ranks can split ``workload``'s sequences (:func:`check_context_parallel`)."""
    if cp == 1:
        return True
    try:
        check_context_parallel(workload, Layout(cp=cp, tp=tp,
                                                sequence_parallel=sequence_parallel))
    except ConfigError:
        return False
    return True
