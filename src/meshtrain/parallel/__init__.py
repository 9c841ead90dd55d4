"""Parallelism applied from outside a plain single-device model.

:func:`parallelize` (:mod:`meshtrain.parallel.apply`) applies a
:class:`~meshtrain.parallel.plan.ParallelPlan`; one subpackage per axis (``tensor``, ``expert``,
``pipeline``, ``context``, ``data``) does the work. The names below load on first use (PEP 562),
so importing a torch-free part of the package (the pipeline schedules and simulator the planner
prices with) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ParallelPlan": "meshtrain.parallel.plan",
    "ParallelState": "meshtrain.parallel.state",
    "ParamSharding": "meshtrain.parallel.sharding",
    "ShardingTable": "meshtrain.parallel.sharding",
    "parallel_state": "meshtrain.parallel.state",
    "parallelize": "meshtrain.parallel.apply",
    "pipeline_stages": "meshtrain.parallel.apply",
    "data_parallel_engine": "meshtrain.parallel.apply",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Import the submodule that defines ``name`` and return it (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'meshtrain.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
