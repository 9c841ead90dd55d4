"""Reusable gradient staging buffers for ZeRO-2/3 reductions.

Each reduce-scatter of a stage-2/3 bucket needs a full-bucket buffer of gradients and a shard
buffer for its result. Allocating them per bucket and step churns (and on the CPU fragments) the
heap, so :class:`StagingPool` keeps a few ``(full, shard)`` pairs sized for the largest bucket. A
pair is busy while a bucket accumulates into it (ZeRO-3 binds a block's ``.grad`` to it before its
backward) or while its reduction is in flight; a request with none free first finishes the
oldest reduction, and adds a pair only when every one is bound to a bucket still accumulating.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

INITIAL_PAIRS = 3


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

    def _new_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        shard = (torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)
                 if self.shard_numel else None)
        return torch.empty(self.full_numel, dtype=self.dtype, device=self.device), shard
