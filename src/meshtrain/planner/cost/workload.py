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
from meshtrain.planner.cost.runtime import (  # noqa: F401 - re-exported: callers import them here
    LLAMA3_2024,
    MEGATRON_2021,
    MEGATRON_2021_TORCH_DDP,
    MEGATRON_2022,
    MEGATRON_CORE_2024,
    MEGATRON_CORE_2025,
    MEGATRON_DEEPSPEED,
    MESHTRAIN,
    STACKS,
    TORCHTITAN_2024,
    TORCHTITAN_2025,
    RuntimeTraits,
)


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
                                     dp_bucket_bytes=config.parallel.dp_bucket_mb * 2**20,
                                     zero3_prefetch=config.parallel.zero3_prefetch)
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
    # Read field by field: the plan search calls this for every layout it prices, and
    # dataclasses.asdict's deep copy of a flat record of scalars costs ten times more.
    return {key: getattr(layout, "pp_schedule" if key == "schedule" else key)
            for key in LAYOUT_JSON_FIELDS}


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


def chunk_layer_counts(model: ModelConfig, layout: Layout) -> list[list[int]]:
    """Per pipeline rank, the layer count of each of its chunks in chunk order (stage ``r``,
    ``r + pp``, ... under the round-robin placement), split as :func:`stage_layers` splits."""
    if layout.pp == 1:
        return [[model.n_layers]]
    stages = layout.pp * layout.chunks_per_rank
    key = (repr(model), stages, layout.pp_split)
    if key not in _CHUNK_COUNTS:
        from meshtrain.parallel.pipeline.stage_split import stage_layers as runtime_stage_layers

        per_stage = runtime_stage_layers(model, model.vocab_size, stages, layout.pp_split)
        _CHUNK_COUNTS[key] = tuple(len(layers) for layers in per_stage)
    counts = _CHUNK_COUNTS[key]
    return [list(counts[r::layout.pp]) for r in range(layout.pp)]


_CHUNK_COUNTS: dict[tuple, tuple[int, ...]] = {}
"""Layer counts per stage, remembered per (model, stages, split) like ``_SPLITS``."""


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
    if lay.pp_split and lay.pp > 1:  # explicit layer counts, empty stages allowed (as runs)
        from meshtrain.parallel.pipeline.stage_split import parse_split

        parse_split(lay.pp_split, m.n_layers, lay.pp * lay.chunks_per_rank)
    else:
        check_pipeline_stages(lay.pp * lay.chunks_per_rank, m.n_layers)
    if lay.pp_schedule == "interleaved-1f1b" and lay.pp > 1:
        check_interleaved_microbatches(lay.pp, lay.microbatches)
    if lay.ep > 1:
        check_expert_degree(lay.ep, lay.dp, lay.tp, m.moe_experts)
    check_global_batch(workload.global_batch, lay.dp, lay.microbatches)
    if lay.cp > 1:
        check_context_parallel(workload, lay)


def check_fp8(workload: Workload, profile_name: str, fp8_rate: float) -> None:
    """Raise :class:`ConfigError` when ``workload`` computes its linear layers in FP8
    (``RuntimeTraits.fp8_linear``) on a profile without FP8 tensor cores (``fp8_rate`` 0), or
    holds its weights in FP8 (``fp8_params``) without FP8 linear layers."""
    if workload.traits.fp8_linear and fp8_rate <= 0:
        raise ConfigError(f"--trait fp8_linear=true: profile {profile_name} has no FP8 tensor "
                          "cores (its fp8_rate is 0), so FP8 linear layers cannot be priced on "
                          "it; valid: an H100-class, H200, B200 or MI300X profile, or "
                          "fp8_linear=false.")
    if workload.traits.fp8_params and not workload.traits.fp8_linear:
        raise ConfigError("--trait fp8_params=true holds the block weights in FP8, which only "
                          "a run with FP8 linear layers does; valid: add --trait "
                          "fp8_linear=true, or fp8_params=false.")


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
        if (lay.pp_schedule == "interleaved-1f1b" and lay.chunks_per_rank > 1
                and lay.pp <= interleave_min_pp(traits) - 1):
            problems.append(f"interleaved-1f1b with parallel.pp = {lay.pp} (it interleaves "
                            f"only with pp > {interleave_min_pp(traits) - 1})")
    if problems:
        raise ConfigError(f"--stack {stack} cannot run this layout: " + "; ".join(problems)
                          + ".")


def interleave_min_pp(traits: RuntimeTraits) -> int:
    """The fewest pipeline ranks a Megatron-style stack interleaves on: 3, or 2 when it
    overlaps the pipeline's sends (``megatron/training/arguments.py`` asks for pp > 2 only
    without ``overlap_p2p_comm``)."""
    return 2 if traits.pp_comm_overlap else 3


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
