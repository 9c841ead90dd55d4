"""Reusable gradient staging buffers for ZeRO-2/3 reductions.

Each reduce-scatter of a stage-2/3 bucket needs a full-bucket buffer of gradients and a shard
buffer for its result (none where the reduction works in place, on the CPU). Allocating them per
bucket churns (and on the CPU fragments) the heap, so :class:`StagingPool` keeps two pairs sized
for the largest bucket while a backward pass runs: one accumulating, one being reduced. A pair
is busy while a bucket accumulates into it (ZeRO-3 binds a unit's ``.grad`` to it before its
backward) or while its reduction is in flight; a request with none free first finishes the
oldest reduction, and adds a pair only when every one is bound to a bucket still accumulating.
Once a micro-batch's reductions are finished the pool lets its buffers go
(:meth:`StagingPool.clear`), so the optimizer step, checkpoints and the final save run without
them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshtrain.config.runtime_facts import INITIAL_PAIRS


class StagingPool:
    """``(full, shard)`` buffer pairs of one dtype, handed out by slot number."""

    def __init__(self, dtype: torch.dtype, full_numel: int, shard_numel: int,
                 device: torch.device):
        """Pairs of ``full_numel`` and ``shard_numel`` elements (the largest bucket's);
        ``shard_numel = 0``: no shard buffers (reductions in place), the shard is None."""
        self.dtype, self.device = dtype, device
        self.full_numel, self.shard_numel = full_numel, shard_numel
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.free: list[int] = []

    def take(self, bucket, finish_oldest: Callable[[], bool]) -> tuple[int, torch.Tensor,
                                                                        torch.Tensor]:
        """A free ``(slot, full, shard)`` cut to ``bucket``'s sizes; ``finish_oldest()``
        completes the oldest reduction in flight (which releases its pair), False when none."""
        if not self.pairs:
            self.pairs = [self._new_pair() for _ in range(INITIAL_PAIRS)]
            self.free = list(range(INITIAL_PAIRS))
        while not self.free and finish_oldest():
            pass
        if not self.free:
            self.pairs.append(self._new_pair())
            self.free.append(len(self.pairs) - 1)
        slot = self.free.pop(0)
        full, shard = self.pairs[slot]
        return slot, full[:bucket.padded_numel], (None if shard is None
                                                  else shard[:bucket.shard_numel])

    def release(self, slot: int) -> None:
        """Return a pair whose reduction has finished."""
        self.free.append(slot)

    def clear(self) -> None:
        """Drop every pair's buffers when none is busy (the next :meth:`take` makes new ones)."""
        if len(self.free) == len(self.pairs):
            self.pairs, self.free = [], []

    def _new_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        shard = (torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)
                 if self.shard_numel else None)
        return torch.empty(self.full_numel, dtype=self.dtype, device=self.device), shard
