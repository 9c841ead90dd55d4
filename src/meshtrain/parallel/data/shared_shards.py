"""ZeRO-3 on one host without gloo: parameter shards and gradient staging in shared memory.

When every rank of a ZeRO-3 group runs on this host (CPU, fp32 gradients, nothing offloaded,
``parallel.dp_shared_memory``), each rank keeps its parameter shards in shared memory that every
other rank of the group maps (:class:`~meshtrain.parallel.shared_memory.SharedMemoryReducer`):

- **Gathering** a unit is a copy of every rank's shard into the unit's full buffer
  (:meth:`~meshtrain.parallel.comm.CountedComm.all_gather_shared`): no gloo message, no
  scratch buffer, no waiting for the other ranks. gloo's in-place gather is one broadcast per
  rank through loopback TCP, whose threads take the cores the step computes on.
- **Reducing** a unit's gradients runs through the reducer (sum of this rank's segment over
  every rank's staging buffer, in rank order): the staging buffers of
  :class:`SharedStagingPool` are shared too.

A shard may be read while its owner computes, so it must not change then. Shards change only
between steps (the optimizer, a checkpoint load, a DiLoCo outer step, an expert move), so the
group meets at two barriers (pipes, ~0.03 ms each; :meth:`SharedShards.settle`): once a
micro-batch's (or a pipelined step's) gradients are reduced, so no rank writes a shard that a
slower rank may still be gathering; and at the first gather after that (or after the engine was
built), so no rank reads a shard before its owner has finished writing it
(:class:`~meshtrain.parallel.data.zero3.ParameterGatherer`). Every rank of a ZeRO-3 group runs
every forward and backward (the gathers were collectives before), so every rank reaches the same
barriers in the same order.
"""

from __future__ import annotations

import torch

from meshtrain.config.runtime_facts import INITIAL_PAIRS
from meshtrain.parallel.data.staging import StagingPool
from meshtrain.parallel.shared_memory import drop_resident_pages


class SharedStagingPool(StagingPool):
    """A :class:`StagingPool` whose first :data:`INITIAL_PAIRS` full buffers live in shared
    memory (allocated at once, collectively, and kept for the whole run: allocating shared
    memory is a collective, which must not happen at a point that depends on timing). A pair
    added beyond those is private, and its bucket is reduced through gloo."""

    def __init__(self, reducer, comm, dtype: torch.dtype, full_numel: int,
                 device: torch.device):
        super().__init__(dtype, full_numel, 0, device)
        self.pairs = [(reducer.new_buffer(comm, full_numel, dtype), None)
                      for _ in range(INITIAL_PAIRS)]
        self.free = list(range(INITIAL_PAIRS))
        self._shared = INITIAL_PAIRS

    def clear(self) -> None:
        """Keep the shared pairs (see the class docstring); drop any private ones when idle."""
        if len(self.free) == len(self.pairs) and len(self.pairs) > self._shared:
            self.pairs = self.pairs[:self._shared]
            self.free = list(range(self._shared))


def shared_staging(engine) -> SharedStagingPool | None:
    """A shared staging pool for a ZeRO-3 ``engine`` whose shards are shared, when all its
    buckets reduce over one group (``dp``; expert buckets reduce over another, so they keep
    private staging and gloo); None otherwise."""
    if (engine.shared_shards is None or list(engine.shared_reducers) != ["dp"]
            or engine.has_expert_buckets):
        return None
    return SharedStagingPool(engine.shared_reducers["dp"], engine.comms["dp"],
                             engine.grad_dtype, engine.staging.full_numel,
                             engine.buckets[0].device)


class SharedShards:
    """The shared-memory side of a ZeRO-3 engine: one reducer per reduction axis whose group is
    on this host (``reducers``)."""

    def __init__(self, reducers: dict):
        self.reducers = reducers

    def new_param_shard(self, bucket, comm, dtype: torch.dtype) -> torch.Tensor | None:
        """A zeroed shared parameter shard for ``bucket`` (collective on its group), or None
        when its axis has no reducer."""
        reducer = self.reducers.get(bucket.axis)
        if reducer is None:
            return None
        return reducer.new_buffer(comm, bucket.shard_numel, dtype)

    def peer_shards(self, bucket) -> list[torch.Tensor] | None:
        """Every rank's parameter shard of ``bucket`` (rank order), or None (gathered by gloo)."""
        reducer = self.reducers.get(bucket.axis)
        if reducer is None or not reducer.owns(bucket.param_shard):
            return None
        return reducer.peer_views(bucket.param_shard)

    @staticmethod
    def drop_peer_pages(shards: list[torch.Tensor], own: int) -> None:
        """After a gather: stop counting the other ranks' shards just read in this process's
        resident memory (:func:`~meshtrain.parallel.shared_memory.drop_resident_pages`), so a
        rank's ``VmHWM`` holds its own shards and the units it has gathered, as under gloo, not
        every rank's shards of the whole model."""
        for k, shard in enumerate(shards):
            if k != own:
                drop_resident_pages(shard)

    def settle(self) -> None:
        """Every rank of every shared group meets here (see the module docstring)."""
        for axis in sorted(self.reducers):
            self.reducers[axis].barrier_after_reductions()
