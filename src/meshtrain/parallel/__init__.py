"""Parallelism applied from outside a plain single-device model.

:func:`parallelize` applies a :class:`~meshtrain.parallel.plan.ParallelPlan` in one fixed order:
tensor parallel -> expert parallel -> pipeline split -> activation checkpointing -> data parallel
(ZeRO). Axes that a plan leaves at degree 1 are skipped, so with every degree 1 the result is the
plain model (plus activation checkpointing if asked for).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from meshtrain.parallel.activation_checkpoint import apply_activation_checkpointing
from meshtrain.parallel.plan import ParallelPlan

if TYPE_CHECKING:
    from meshtrain.mesh import ParallelMesh

__all__ = ["ParallelPlan", "data_parallel_engine", "parallelize"]


def parallelize(model: torch.nn.Module, mesh: ParallelMesh, plan: ParallelPlan) -> torch.nn.Module:
    """Apply ``plan`` to ``model`` on ``mesh`` and return the (possibly wrapped) model."""
    for axis in ("dp", "tp", "pp", "ep"):
        if getattr(plan, axis) != getattr(mesh, axis):
            raise ValueError(f"plan.{axis} = {getattr(plan, axis)} but the mesh has "
                             f"{axis} = {getattr(mesh, axis)}")
    if plan.tp > 1 or plan.pp > 1 or plan.ep > 1:
        raise NotImplementedError("tensor, pipeline and expert parallelism are not built yet")
    apply_activation_checkpointing(model, plan.activation_checkpointing)
    from meshtrain.parallel.data import apply_data_parallel

    model._meshtrain_dp_engine = apply_data_parallel(
        model, mesh.comm("dp"), mesh.dp_rank, plan.zero, plan.dp_bucket_mb)
    return model


def data_parallel_engine(model: torch.nn.Module):
    """The :class:`~meshtrain.parallel.data.DataParallelEngine` that :func:`parallelize`
    installed on ``model`` (it owns the flat parameter/gradient buffers)."""
    engine = getattr(model, "_meshtrain_dp_engine", None)
    if engine is None:
        raise ValueError("model has not been through meshtrain.parallel.parallelize")
    return engine
