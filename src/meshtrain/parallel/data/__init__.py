"""Data parallelism (bucketed, overlapped gradient reduction) and ZeRO stages 1-3."""

from __future__ import annotations

import functools

import torch

from meshtrain.model.feed_forward import FeedForward
from meshtrain.model.transformer import Attention, TransformerBlock
from meshtrain.parallel.data.engine import DataParallelEngine, OptimizerShard
from meshtrain.parallel.data.offloaded import OffloadedEngine
from meshtrain.parallel.data.zero3 import ParameterGatherer
from meshtrain.parallel.state import attach_parallel_state, shardings_of

__all__ = ["DataParallelEngine", "OffloadedEngine", "OptimizerShard", "ParameterGatherer",
           "apply_data_parallel"]


#: Modules whose forward calls each parameter-holding child as a module (so the child's hooks
#: see every use of its parameters): only these are split into smaller ZeRO-3 units.
_SPLITTABLE = (TransformerBlock, Attention, FeedForward)


def _holds_matrix(module: torch.nn.Module) -> bool:
    return any(p.ndim >= 2 for p in module.parameters())


def _split_unit(module: torch.nn.Module, prefix: str, limit: float, units: list) -> None:
    """Append ``module``'s ZeRO-3 units to ``units`` as ``(module, named params)`` in forward
    (registration) order: the module itself when its parameters fit in ``limit`` bytes or it is
    not one of :data:`_SPLITTABLE`, else each child holding a matrix, split the same way.
    Vector-only children (norm weights) are left out: they join the root unit."""
    named = [(prefix + n, p) for n, p in module.named_parameters()]
    size = sum(p.numel() * p.element_size() for _, p in named)
    own = list(module.named_parameters(recurse=False))
    if size <= limit or not isinstance(module, _SPLITTABLE) or own:
        units.append((module, named))
        return
    for name, child in module.named_children():
        if _holds_matrix(child):
            _split_unit(child, f"{prefix}{name}.", limit, units)


def _zero3_units(model: torch.nn.Module, bucket_bytes: int) -> tuple[list, list]:
    """ZeRO-3 units in forward order, ``(module, named params)`` each, and the root (everything
    outside them). A block whose parameters exceed ``bucket_bytes`` is split into its
    sub-modules (attention, MLP, and further down to single projections), so what is gathered,
    staged and reduced at once is at most about a bucket; a compiled block stays one unit (the
    hooks of its sub-modules would run inside the compiled graph)."""
    compiled = attach_parallel_state(model).compiled
    units: list = []
    for key, block in model.layers.items():
        limit = bucket_bytes if f"layers.{key}" not in compiled else float("inf")
        _split_unit(block, f"layers.{key}.", limit, units)
    placed = {id(p) for _, group in units for _, p in group}
    root = [(n, p) for n, p in model.named_parameters() if id(p) not in placed]
    return units, root


def _by_axis(named: list, shardings) -> list[tuple[str, list]]:
    """``named`` parameters cut into one group per reduction axis (``"dp"`` first, then
    ``"edp"``: expert parameters, held only by their expert group), empty groups left out."""
    groups = {"dp": [], "edp": []}
    for name, param in named:
        groups[shardings[name].dp_axis].append((name, param))
    return [(axis, params) for axis, params in groups.items() if params]


def apply_data_parallel(model: torch.nn.Module, mesh, zero: int,
                        bucket_mb: float, shared_memory: bool = True,
                        grad_dtype: torch.dtype = torch.float32,
                        init_values=None, offload=None, prefetch: int = 1) -> DataParallelEngine:
    """Flatten ``model``'s parameters into buckets, install the gradient hooks of ZeRO stage
    ``zero`` (0 = plain DP) and, for stage 3, the gather/free hooks of each unit
    (:func:`_zero3_units`: a block, or its sub-modules when it exceeds ``bucket_mb``).
    Under ZeRO-3 a unit holding expert parameters (an MoE layer's experts beside its router)
    is one bucket per reduction axis: the dense part sharded over ``dp``, the experts over
    ``edp``; the gatherer gathers and frees a unit's buckets together.
    ``shared_memory``, ``grad_dtype`` and ``init_values``: see :class:`DataParallelEngine`;
    ``offload``: an :class:`~meshtrain.parallel.offload.store.OffloadStore` to keep this
    rank's shards in (an :class:`OffloadedEngine`), None = none; ``prefetch``: ZeRO-3 units
    gathered ahead of the running one (:class:`ParameterGatherer`)."""
    bucket_bytes = int(bucket_mb * 2**20)
    engine_class = DataParallelEngine
    if offload is not None:
        engine_class = functools.partial(OffloadedEngine, offload=offload)
    if zero < 3:
        return engine_class(model, mesh, zero, bucket_bytes, shared_memory=shared_memory,
                            grad_dtype=grad_dtype, init_values=init_values)
    units, root = _zero3_units(model, bucket_bytes)
    shardings = shardings_of(model)
    unit_groups = [_by_axis(params, shardings) for _, params in units]
    # A tied embedding is a root bucket of its own, laid out and sharded alike on the first
    # and last pipeline stage, whose gradient shards are then summed between them.
    tied = [(n, p) for n, p in root if shardings[n].tied]
    root_groups = _by_axis([(n, p) for n, p in root if not shardings[n].tied], shardings)
    root_groups += _by_axis(tied, shardings)
    # Buckets in reverse forward order (the order backward finishes them), the root last.
    groups = [g for unit in reversed(unit_groups) for g in unit] + root_groups
    engine = engine_class(model, mesh, 3, bucket_bytes, units=groups, grad_dtype=grad_dtype,
                          init_values=init_values, shared_memory=shared_memory)
    buckets = iter(engine.buckets)
    by_unit = [[next(buckets) for _ in unit] for unit in reversed(unit_groups)][::-1]
    engine.gatherer = ParameterGatherer(engine, model, [m for m, _ in units], by_unit,
                                        list(buckets), prefetch)
    return engine
