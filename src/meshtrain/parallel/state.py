"""What :func:`~meshtrain.parallel.parallelize` leaves on the model it parallelises.

One :class:`ParallelState` per parallelised model, attached as ``model.parallel_state``: the
sharding records of its parameters, its pipeline stages, its data-parallel engine and which of
its modules were wrapped (activation checkpointing, ``torch.compile``). Everything that needs
these facts later (the trainer, checkpoints, the final-weights gather) reads them from here;
nothing is stored on the parameters themselves.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from meshtrain.parallel.sharding import ShardingTable

if TYPE_CHECKING:
    from meshtrain.parallel.data import DataParallelEngine

#: The root model's attribute holding its :class:`ParallelState`.
STATE_ATTRIBUTE = "parallel_state"


@dataclasses.dataclass
class ParallelState:
    """The parallel layout of one model on this rank.

    ``shardings``: every parameter's :class:`~meshtrain.parallel.sharding.ParamSharding`;
    ``pipeline``: ``(schedule, chunks by stage)`` when the model was split into pipeline stages;
    ``dp_engine``: the data-parallel engine owning the flat buffers; ``checkpointed`` and
    ``compiled``: qualified names of the modules whose forward recomputes in backward, and of the
    blocks whose forward is compiled.
    """

    shardings: ShardingTable = dataclasses.field(default_factory=ShardingTable)
    pipeline: tuple | None = None
    dp_engine: DataParallelEngine | None = None
    checkpointed: set[str] = dataclasses.field(default_factory=set)
    compiled: set[str] = dataclasses.field(default_factory=set)


def parallel_state(model: torch.nn.Module) -> ParallelState | None:
    """``model``'s :class:`ParallelState`, or None for a model never parallelised."""
    state = model.__dict__.get(STATE_ATTRIBUTE)
    return state if isinstance(state, ParallelState) else None


def attach_parallel_state(model: torch.nn.Module) -> ParallelState:
    """``model``'s :class:`ParallelState`, attached empty first if it has none."""
    state = parallel_state(model)
    if state is None:
        state = ParallelState()
        setattr(model, STATE_ATTRIBUTE, state)
    return state


def shardings_of(model: torch.nn.Module) -> ShardingTable:
    """The sharding records of ``model``'s parameters (for a model never parallelised, a new
    table in which every parameter is whole)."""
    state = parallel_state(model)
    if state is not None:
        return state.shardings
    table = ShardingTable()
    table.align(name for name, _ in model.named_parameters())
    return table
