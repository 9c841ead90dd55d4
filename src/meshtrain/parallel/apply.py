"""Applying a :class:`~meshtrain.parallel.plan.ParallelPlan` to a plain model.

:func:`parallelize` applies the plan in one fixed order: tensor parallel -> expert parallel ->
pipeline split -> context parallel -> activation checkpointing -> data parallel (ZeRO). Axes that
a plan leaves at degree 1 are skipped, so with every degree 1 the result is the plain model (plus
activation checkpointing if asked for). What the splits decide is kept in the model's
:class:`~meshtrain.parallel.state.ParallelState` (``model.parallel_state``): one sharding record
per parameter (:class:`~meshtrain.parallel.sharding.ParamSharding`), the pipeline stages and the
data-parallel engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshtrain.parallel.activation_checkpoint import apply_activation_checkpointing
from meshtrain.parallel.plan import ParallelPlan
from meshtrain.parallel.sharding import ShardingTable
from meshtrain.parallel.state import attach_parallel_state, parallel_state

if TYPE_CHECKING:
    from meshtrain.parallel.mesh import ParallelMesh



def parallelize(model: torch.nn.Module, mesh: ParallelMesh, plan: ParallelPlan) -> torch.nn.Module:
    """Apply ``plan`` to ``model`` on ``mesh`` and return it.

    ``model`` may be built on the meta device (preferred: no rank ever holds the full model);
    it is then materialised on ``mesh.device`` after the splits, each parameter initialised from
    its name and ``plan.init_seed`` and cut to this rank's piece.
    """
    for axis in ("dp", "tp", "pp", "ep", "cp"):
        if getattr(plan, axis) != getattr(mesh, axis):
            raise ValueError(f"plan.{axis} = {getattr(plan, axis)} but the mesh has "
                             f"{axis} = {getattr(mesh, axis)}")
    state = attach_parallel_state(model)
    if plan.tp > 1:
        from meshtrain.parallel.tensor.apply import apply_tensor_parallel

        apply_tensor_parallel(model, mesh.comm("tp"), mesh.tp_rank, plan.tp_rules,
                              plan.sequence_parallel, state.shardings)
    if plan.ep > 1:
        from meshtrain.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, mesh.comm("ep"), mesh.ep_rank, state.shardings,
                              mesh.comm("tp"), mesh.tp_rank)
    if plan.pp > 1:
        from meshtrain.parallel.pipeline import build_schedule, check_schedule
        from meshtrain.parallel.pipeline.stage import split_model
        from meshtrain.parallel.pipeline.stage_split import stage_layers

        schedule = build_schedule(plan.pp_schedule, plan.pp, plan.microbatches,
                                  plan.virtual_stages)
        check_schedule(schedule)
        layers = stage_layers(model.config, model.config.vocab_size, schedule.num_stages,
                              plan.pp_split)
        chunks = split_model(model, schedule.stages_of(mesh.pp_rank), layers,
                             schedule.defers_weight_grads)
        state.pipeline = (schedule, chunks)
        if model.config.tie_embeddings:
            _mark_tied_embedding(model, mesh, schedule, state.shardings)
    if plan.cp > 1:
        from meshtrain.parallel.context import apply_context_parallel

        apply_context_parallel(model, mesh.comm("cp"), mesh.cp_rank)
    state.shardings.align(name for name, _ in model.named_parameters())
    init_values = None
    if any(p.is_meta for p in model.parameters()):
        init_values = _materialize(model, mesh.device, plan, state.shardings)
    apply_activation_checkpointing(model, plan.activation_checkpointing)
    if plan.compile_blocks:
        from meshtrain.parallel.compile import compile_blocks

        compile_blocks(model)  # after checkpointing: the compiled graph holds the checkpoint
    from meshtrain.parallel.data import apply_data_parallel
    from meshtrain.parallel.offload.store import open_store

    grad_dtype = torch.bfloat16 if plan.grad_dtype == "bf16" else torch.float32
    state.dp_engine = apply_data_parallel(model, mesh, plan.zero, plan.dp_bucket_mb,
                                          plan.dp_shared_memory, grad_dtype, init_values,
                                          offload=open_store(plan, mesh),
                                          prefetch=plan.zero3_prefetch)
    return model


def _mark_tied_embedding(model: torch.nn.Module, mesh: ParallelMesh, schedule,
                         shardings: ShardingTable) -> None:
    """Record the tied embedding of a split model: held by the first and the last stage, its
    gradient summed over the mesh's ``tied`` group (which must join exactly those ranks)."""
    ends = schedule.embedding_ranks
    if len(ends) > 1 and mesh.tied_pp_ranks != ends:
        raise ValueError(f"the mesh's tied_pp_ranks {mesh.tied_pp_ranks} are not the pipeline "
                         f"ranks of the first and last stage {ends} (build "
                         f"the mesh with them: meshtrain.run.worker.build_mesh does)")
    if model.tok_embeddings is None or not mesh.comm("tied").active:
        return  # a middle stage, or one rank holds both ends
    first = mesh.pp_rank == schedule.rank_of(schedule.first_stage)
    shardings.update("tok_embeddings.weight", tied=True, tied_copy=not first)


def _materialize(model: torch.nn.Module, device: torch.device, plan: ParallelPlan,
                 shardings: ShardingTable):
    """Allocate a meta-built model on ``device``, uninitialised, and return the function that
    gives each parameter's initial value (the name-seeded init of this rank's piece), for the
    data-parallel engine to write straight into its flat buffers bucket by bucket (or only into
    this rank's ZeRO-3 shard). The per-parameter storage ``to_empty`` reserves is never written,
    so it never becomes resident, and is released when the engine rebinds the parameters: no
    rank ever holds more than its buckets plus one full parameter. The parameters' sharding
    records (``shardings``, by name) say which piece each one is.

    On the meta device itself (a dry run, :mod:`meshtrain.commands.dry_run`) only the dtype changes:
    no storage, no init (returns None)."""
    from meshtrain.model import moe_layers
    from meshtrain.model.init import reset_buffers
    from meshtrain.parallel.initial_values import initial_value

    # Moving off the meta device replaces the Parameter objects; the records are keyed by name.
    model.to(torch.bfloat16 if plan.param_dtype == "bf16" else torch.float32)  # still meta: free
    model.to_empty(device=device)
    reset_buffers(model)
    for moe in moe_layers(model):
        moe.expert_bias = moe.expert_bias.float()
    if device.type == "meta":
        return None
    config, seed = model.config, plan.init_seed
    return lambda name, param, flat_range=None: initial_value(name, param, seed, config,
                                                              shardings[name], flat_range)


def pipeline_stages(model: torch.nn.Module):
    """``(schedule, chunks by stage)`` when ``model`` was split into pipeline stages, else None."""
    state = parallel_state(model)
    return state.pipeline if state is not None else None


def data_parallel_engine(model: torch.nn.Module):
    """The :class:`~meshtrain.parallel.data.DataParallelEngine` that :func:`parallelize`
    installed on ``model`` (it owns the flat parameter/gradient buffers)."""
    state = parallel_state(model)
    if state is None or state.dp_engine is None:
        raise ValueError("model has not been through meshtrain.parallel.parallelize")
    return state.dp_engine
