"""Micro-batches prepared one step ahead and copied to the device without blocking.

:class:`BatchPrefetcher` wraps a :class:`~meshtrain.data.train_data.TrainData`. While step k
runs, :meth:`BatchPrefetcher.prefetch` builds step k+1's micro-batches on the host (sampling,
slicing), pins them on CUDA and starts their copies with ``non_blocking=True`` on the current
stream, so the copies are ordered before step k+1's kernels and overlap step k's tail. On CPU the
batches stay where they are (``.to`` of a CPU tensor to the CPU is free). The sampler itself
advances only when a step *takes* its batch, so the data position saved in a checkpoint is
unchanged."""

from __future__ import annotations

import torch
from torch import Tensor


class BatchPrefetcher:
    """One step's micro-batches ahead of the trainer; see the module docstring."""

    def __init__(self, data, device: torch.device, ignore_index: int):
        self.data, self.device, self.ignore_index = data, device, ignore_index
        self._ready: tuple[int, list, int, list] | None = None

    def _build(self, step: int) -> tuple[int, list, int, list]:
        sampler, dataset = self.data.sampler, self.data.dataset
        host = [dataset.batch(idx) for idx in sampler.local_microbatch_indices(step)]
        # tokens to predict, counted on the host: no device read for the loss normaliser
        tokens = sum(int((targets != self.ignore_index).sum()) for _, targets in host)
        if self.device.type != "cuda":
            return step, host, tokens, host
        pinned = [(x.pin_memory(), y.pin_memory()) for x, y in host]
        moved = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                 for x, y in pinned]
        return step, moved, tokens, pinned  # pinned kept alive until the copies are used

    def prefetch(self) -> None:
        """Prepare the batch of the step after the one taken last (call while a step runs)."""
        step = self.data.step
        if self._ready is None or self._ready[0] != step:
            self._ready = self._build(step)

    def next_step(self) -> tuple[list[tuple[Tensor, Tensor]], int]:
        """This step's micro-batches (on the device) and their local target-token count; then
        advance the sampler one step."""
        self.prefetch()
        _, batches, tokens, _ = self._ready
        self.data.sampler.advance()
        return batches, tokens
