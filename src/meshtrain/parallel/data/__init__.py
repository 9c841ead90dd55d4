"""Data parallelism (bucketed, overlapped gradient reduction) and ZeRO stages 1-3."""

from __future__ import annotations

import torch

from meshtrain.parallel.data.engine import DataParallelEngine, OptimizerShard
from meshtrain.parallel.data.zero3 import ParameterGatherer

__all__ = ["DataParallelEngine", "OptimizerShard", "ParameterGatherer", "apply_data_parallel"]


def _block_units(model: torch.nn.Module) -> tuple[list[torch.nn.Module], list, list]:
    """ZeRO-3 units: each transformer block, plus the root (everything outside the blocks)."""
    blocks = list(model.layers.values())
    block_params = [[(f"layers.{key}.{n}", p) for n, p in block.named_parameters()]
                    for key, block in model.layers.items()]
    in_blocks = {id(p) for group in block_params for _, p in group}
    root = [(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks]
    return blocks, block_params, root


def apply_data_parallel(model: torch.nn.Module, mesh, zero: int,
                        bucket_mb: float, shared_memory: bool = True,
                        grad_dtype: torch.dtype = torch.float32,
                        init_values=None) -> DataParallelEngine:
    """Flatten ``model``'s parameters into buckets, install the gradient hooks of ZeRO stage
    ``zero`` (0 = plain DP) and, for stage 3, the per-block gather/free hooks. ``shared_memory``,
    ``grad_dtype`` and ``init_values``: see :class:`DataParallelEngine`."""
    bucket_bytes = int(bucket_mb * 2**20)
    if zero < 3:
        return DataParallelEngine(model, mesh, zero, bucket_bytes, shared_memory=shared_memory,
                                  grad_dtype=grad_dtype, init_values=init_values)
    blocks, block_params, root = _block_units(model)
    units = list(reversed(block_params)) + ([root] if root else [])
    engine = DataParallelEngine(model, mesh, 3, bucket_bytes, units=units, grad_dtype=grad_dtype,
                                init_values=init_values)
    n = len(blocks)
    block_buckets = [engine.buckets[n - 1 - i] for i in range(n)]
    root_bucket = engine.buckets[n] if root else None
    engine.gatherer = ParameterGatherer(engine, model, blocks, block_buckets, root_bucket)
    return engine
