"""The deterministic order of training samples: which samples form each step's global batch,
and which of them each data-parallel rank and micro-batch takes.

:class:`GlobalBatchSampler` assigns each step's global batch to data-parallel ranks and
micro-batches as contiguous slices (:func:`rank_microbatches`), so the sequences of a step never
depend on the layout. Weighted mixtures of sources have their own sampler with the same interface
(:class:`~meshtrain.data.mixture.MixtureSampler`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshtrain.config import ConfigError


def rank_microbatches(indices: list, dp_rank: int, dp_size: int,
                      microbatches: int) -> list[list]:
    """Data-parallel rank ``dp_rank``'s contiguous share of a global batch's ``indices``, cut
    into ``microbatches`` equal lists (every sampler and the evaluator split batches this way,
    so the sequences of a batch never depend on the layout)."""
    per_rank = len(indices) // dp_size
    per_micro = per_rank // microbatches
    mine = indices[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [mine[j * per_micro:(j + 1) * per_micro] for j in range(microbatches)]


class GlobalBatchSampler:
    """Deterministic assignment of samples to steps, data-parallel ranks and micro-batches.

    Epoch ``e`` visits the samples in ``torch.randperm`` order from a generator seeded with
    ``seed * 1_000_003 + e``; epochs are concatenated into one stream and the global batch of step
    ``k`` is stream positions ``[k*GB, (k+1)*GB)`` (it may straddle two epochs). That batch does
    not depend on ``dp_size`` or ``microbatches``: rank ``r`` takes the contiguous slice
    ``[r*GB/dp, (r+1)*GB/dp)`` and micro-batch ``j`` is the ``j``-th equal chunk of that slice.
    ``step`` is the position of the next step to train, saved by :meth:`state_dict`.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1, microbatches: int = 1):
        if num_samples < 1:
            raise ConfigError("the training data holds no complete sample; add data or shorten "
                              "train.seq_len.")
        if global_batch < 1 or dp_size < 1 or microbatches < 1:
            raise ConfigError(f"train.global_batch ({global_batch}), dp ({dp_size}) and "
                              f"microbatches ({microbatches}) must all be at least 1.")
        if global_batch % (dp_size * microbatches):
            raise ConfigError(
                f"train.global_batch = {global_batch} is not divisible by dp × microbatches = "
                f"{dp_size} × {microbatches} = {dp_size * microbatches}; choose a multiple of "
                f"{dp_size * microbatches}."
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.microbatches = microbatches
        self.step = 0
        self._epochs: dict[int, Tensor] = {}

    def epoch_order(self, epoch: int) -> Tensor:
        """The permutation of ``range(num_samples)`` that epoch ``epoch`` visits (an int32
        tensor, int64 beyond 2^31 samples)."""
        if epoch not in self._epochs:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            if len(self._epochs) >= 2:  # a step spans at most two epochs when GB <= num_samples
                self._epochs.pop(min(self._epochs))
            # int32 halves the largest per-corpus allocation (the same permutation as int64)
            dtype = torch.int32 if self.num_samples < 2**31 else torch.int64
            self._epochs[epoch] = torch.randperm(self.num_samples, generator=generator,
                                                 dtype=dtype)
        return self._epochs[epoch]

    def global_indices(self, step: int) -> list[int]:
        """Sample indices of the whole global batch of ``step`` (all ranks, all micro-batches)."""
        indices: list[int] = []
        position, end = step * self.global_batch, (step + 1) * self.global_batch
        while position < end:
            epoch, offset = divmod(position, self.num_samples)
            take = min(end - position, self.num_samples - offset)
            indices.extend(self.epoch_order(epoch)[offset : offset + take].tolist())
            position += take
        return indices

    def local_microbatch_indices(self, step: int) -> list[list[int]]:
        """This rank's share of step ``step``, split into ``microbatches`` equal lists."""
        return rank_microbatches(self.global_indices(step), self.dp_rank, self.dp_size,
                                 self.microbatches)

    def advance(self) -> None:
        """Move past the current step."""
        self.step += 1

    def state_dict(self) -> dict[str, int]:
        """The resumable position: the next step, and the settings it is only valid under."""
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["step"]``; refuse a position saved under another seed/global batch."""
        for key in ("seed", "global_batch"):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"cannot resume the data order: it was saved with {key} = {state[key]} but "
                    f"this run uses {key} = {getattr(self, key)}; the same step would select "
                    f"different samples. Restore train.{key} = {state[key]} or start afresh."
                )
        self.step = int(state["step"])
