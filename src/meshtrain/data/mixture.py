"""Weighted mixtures of data sources (``data.sources``), sampled deterministically.

Each source is tokenized and packed on its own (:class:`~meshtrain.data.packing.PackedDataset`);
:class:`MixedDataset` puts their samples in one index space (source ``i``'s sample ``j`` is
``offsets[i] + j``), so the rest of the data path (batching, prefetch) is unchanged.

:class:`MixtureSampler` decides which source fills each position of the global sample stream
(position ``p`` = step × global batch + slot). Positions are assigned in order, each to the
source furthest below its share: the one with the largest ``weight_i × (p + 1) − consumed_i``
(ties to the first source). So after any number of samples every source has consumed its weight's
share to within one sample, exactly, not in expectation; the k-th sample a source contributes is
position k of that source's own sequence of epochs (a fresh permutation per epoch, seeded by the
run seed, the source's index and the epoch). The assignment depends only on the weights, the seed
and the global position, never on the layout, and the state needed to resume is the step and the
samples consumed per source, saved in checkpoints.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from meshtrain.config import ConfigError
from meshtrain.data.packing import PackedDataset, hold_out_tail
from meshtrain.data.sampler import rank_microbatches
from meshtrain.data.shards import TokenShards
from meshtrain.data.sources import load_token_stream


class MixedDataset:
    """Several packed datasets seen as one, sample ``offsets[i] + j`` being source ``i``'s ``j``."""

    def __init__(self, datasets: list):
        self.datasets = datasets
        self.offsets = []
        total = 0
        for dataset in datasets:
            self.offsets.append(total)
            total += len(dataset)
        self.total = total

    def __len__(self) -> int:
        return self.total

    def source_of(self, index: int) -> tuple[int, int]:
        """``(source, sample within it)`` of a mixed index."""
        for source in range(len(self.datasets) - 1, -1, -1):
            if index >= self.offsets[source]:
                return source, index - self.offsets[source]
        raise IndexError(index)

    def batch(self, indices: list[int]) -> tuple[Tensor, Tensor]:
        """Samples ``indices`` stacked: ``(inputs, targets)``, each ``[len(indices), seq_len]``."""
        rows = [self.datasets[s][j] for s, j in map(self.source_of, indices)]
        return (torch.stack([x for x, _ in rows]).contiguous(),
                torch.stack([y for _, y in rows]).contiguous())


class MixtureSampler:
    """The global batch of each step drawn from weighted sources (see the module docstring);
    the same interface as :class:`~meshtrain.data.sampler.GlobalBatchSampler`."""

    def __init__(self, sizes: list[int], weights: list[float], names: list[str],
                 global_batch: int, seed: int, dp_rank: int = 0, dp_size: int = 1,
                 microbatches: int = 1):
        if global_batch % (dp_size * microbatches):
            raise ConfigError(
                f"train.global_batch = {global_batch} is not divisible by dp × microbatches = "
                f"{dp_size} × {microbatches}; choose a multiple of {dp_size * microbatches}.")
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        self.sizes, self.names = list(sizes), list(names)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.global_batch, self.seed = global_batch, seed
        self.dp_rank, self.dp_size, self.microbatches = dp_rank, dp_size, microbatches
        self.step = 0
        self.consumed = [0] * len(sizes)
        self._planned: tuple[int, list[int], list[int]] | None = None
        self._epochs: dict[tuple[int, int], Tensor] = {}

    def _order(self, source: int, epoch: int) -> Tensor:
        key = (source, epoch)
        if key not in self._epochs:
            seed = (self.seed * 1_000_003 + source * 7_919 + epoch) % 2**63
            if len(self._epochs) >= 2 * len(self.sizes):
                self._epochs.pop(next(iter(self._epochs)))
            dtype = torch.int32 if self.sizes[source] < 2**31 else torch.int64
            self._epochs[key] = torch.randperm(self.sizes[source], dtype=dtype,
                                               generator=torch.Generator().manual_seed(seed))
        return self._epochs[key]

    def _plan(self, step: int) -> tuple[list[int], list[int]]:
        """Mixed indices of step ``step``'s global batch and the samples it takes per source."""
        if step != self.step:
            raise ValueError(f"a mixture is sampled step by step: step {step} asked at {self.step}")
        if self._planned is None or self._planned[0] != step:
            consumed, counts, indices = list(self.consumed), [0] * len(self.sizes), []
            position = sum(consumed)
            for _ in range(self.global_batch):
                deficits = [w * (position + 1) - c for w, c in zip(self.weights, consumed,
                                                                   strict=True)]
                source = max(range(len(deficits)), key=lambda i: (deficits[i], -i))
                epoch, offset = divmod(consumed[source], self.sizes[source])
                indices.append(self.offsets[source] + int(self._order(source, epoch)[offset]))
                consumed[source] += 1
                counts[source] += 1
                position += 1
            self._planned = (step, indices, counts)
        return self._planned[1], self._planned[2]

    def global_indices(self, step: int) -> list[int]:
        """Mixed sample indices of the whole global batch of ``step``."""
        return self._plan(step)[0]

    def local_microbatch_indices(self, step: int) -> list[list[int]]:
        """This rank's share of step ``step``, split into ``microbatches`` equal lists."""
        return rank_microbatches(self.global_indices(step), self.dp_rank, self.dp_size,
                                 self.microbatches)

    def advance(self) -> None:
        """Move past the current step (its samples count as consumed)."""
        _, counts = self._plan(self.step)
        self.consumed = [c + n for c, n in zip(self.consumed, counts, strict=True)]
        self.step += 1

    def samples_per_source(self) -> dict[str, int]:
        """Samples every source has contributed so far (all ranks)."""
        return dict(zip(self.names, self.consumed, strict=True))

    def state_dict(self) -> dict:
        """The resumable position and the mixture it is valid under."""
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch,
                "consumed": list(self.consumed), "sources": list(self.names),
                "weights": list(self.weights)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position; refuse one saved with another mixture or seed."""
        for key in ("seed", "global_batch"):
            if int(state.get(key, -1)) != getattr(self, key):
                raise ValueError(f"cannot resume the data order: it was saved with {key} = "
                                 f"{state.get(key)} but this run uses {getattr(self, key)}.")
        if state.get("sources") != self.names or any(
                abs(a - b) > 1e-12 for a, b in zip(state.get("weights", []), self.weights,
                                                   strict=False)):
            raise ValueError(f"cannot resume the data order: it was saved with the mixture "
                             f"{state.get('sources')} (weights {state.get('weights')}) but this "
                             f"run mixes {self.names} (weights {self.weights}); restore "
                             "data.sources or start afresh.")
        self.step, self.consumed = int(state["step"]), [int(c) for c in state["consumed"]]
        self._planned = None


def mixture_data(data_cfg, train_cfg, tokenizer, dp_rank: int, dp_size: int, microbatches: int,
                 cache_dir=None) -> tuple[TokenShards, TokenShards | None, MixedDataset,
                                          MixtureSampler]:
    """``(training tokens, held-out tokens, dataset, sampler)`` of ``data.sources``: each source
    loaded as ``data.source`` would be, its tail held out under ``data.valid_fraction``."""
    datasets, train_parts, held_parts, names = [], [], [], []
    for item in data_cfg.sources:
        single = dataclasses.replace(data_cfg, source=item["path"], sources=[])
        tokens = load_token_stream(single, tokenizer, cache_dir)
        if data_cfg.valid_fraction:
            tokens, held = hold_out_tail(tokens, data_cfg.valid_fraction, tokenizer.eos_id)
            held_parts.append(held)
        dataset = PackedDataset(tokens, train_cfg.seq_len)
        if len(dataset) < 1:
            raise ConfigError(f'data.sources: "{item["path"]}" gives {len(tokens)} tokens, no '
                              f"complete sample of train.seq_len = {train_cfg.seq_len}; add data "
                              "or drop the source.")
        datasets.append(dataset)
        train_parts.append(tokens)
        names.append(item["path"])
    sampler = MixtureSampler([len(d) for d in datasets], [i["weight"] for i in data_cfg.sources],
                             names, train_cfg.global_batch, train_cfg.seed, dp_rank, dp_size,
                             microbatches)
    held_out = TokenShards.concat(held_parts) if data_cfg.valid_fraction else None
    return TokenShards.concat(train_parts), held_out, MixedDataset(datasets), sampler
