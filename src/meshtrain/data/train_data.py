"""The trainer's data: one source (``data.source``) or a weighted mixture (``data.sources``),
packed into samples and ordered by a seeded, resumable sampler."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch import Tensor

from meshtrain.config import ConfigError, DataConfig, TrainConfig
from meshtrain.config.layout_rules import batch_readers
from meshtrain.data.mixture import mixture_data
from meshtrain.data.packing import PackedDataset, hold_out_tail
from meshtrain.data.sampler import GlobalBatchSampler
from meshtrain.data.shards import TokenShards
from meshtrain.data.sources import load_token_stream


class TrainData:
    """The trainer's view of the data: ``next_step()`` yields this rank's micro-batches.

    Loads the token stream of ``data_cfg`` with ``tokenizer``, packs it into
    ``train_cfg.seq_len`` samples and orders them with a :class:`GlobalBatchSampler` seeded by
    ``train_cfg.seed``. Its ``state_dict`` is the sampler position, which checkpoints save so a
    resumed run continues with exactly the batches it would have seen. ``cache_dir`` is passed to
    :func:`load_token_stream`.
    """

    def __init__(self, data_cfg: DataConfig, train_cfg: TrainConfig, tokenizer,
                 dp_rank: int = 0, dp_size: int = 1, microbatches: int = 1,
                 cache_dir: str | Path | None = None):
        self.tokenizer = tokenizer
        self.seq_len = train_cfg.seq_len
        if data_cfg.sources:
            self.tokens, self.held_out, self.dataset, self.sampler = mixture_data(
                data_cfg, train_cfg, tokenizer, dp_rank, dp_size, microbatches, cache_dir)
            self.num_samples = len(self.dataset)
            return
        self.tokens = load_token_stream(data_cfg, tokenizer, cache_dir)
        self.held_out: TokenShards | None = None
        if data_cfg.valid_fraction:
            self.tokens, self.held_out = hold_out_tail(self.tokens, data_cfg.valid_fraction,
                                                       tokenizer.eos_id)
        self.dataset = PackedDataset(self.tokens, train_cfg.seq_len)
        self.num_samples = len(self.dataset)
        if self.num_samples < train_cfg.global_batch:
            raise ConfigError(
                f'data.source "{data_cfg.source}" gives {len(self.tokens)} tokens = '
                f"{self.num_samples} samples of train.seq_len = {train_cfg.seq_len}, fewer than "
                f"one global batch (train.global_batch = {train_cfg.global_batch}). Use a smaller "
                "seq_len or global_batch, or more data."
            )
        self.sampler = GlobalBatchSampler(self.num_samples, train_cfg.global_batch,
                                          train_cfg.seed, dp_rank, dp_size, microbatches)

    @property
    def step(self) -> int:
        """The step whose batch :meth:`next_step` returns next."""
        return self.sampler.step

    def next_step(self) -> list[tuple[Tensor, Tensor]]:
        """This rank's micro-batches of the current step, ``[(inputs, targets), ...]``, each
        ``[global_batch / (dp × microbatches), seq_len]`` int64; then advance one step."""
        micro = self.sampler.local_microbatch_indices(self.sampler.step)
        self.sampler.advance()
        return [self.dataset.batch(indices) for indices in micro]

    def tokens_per_source(self) -> dict[str, int] | None:
        """Tokens each mixture source has contributed to training so far (all ranks; None
        without ``data.sources``)."""
        per_source = getattr(self.sampler, "samples_per_source", None)
        if per_source is None:
            return None
        return {name: n * self.seq_len for name, n in per_source().items()}

    def state_dict(self) -> dict[str, int]:
        """The sampler position (see :meth:`GlobalBatchSampler.state_dict`)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume the sampler position saved by :meth:`state_dict`."""
        self.sampler.load_state_dict(state)


def trainer_data(config, mesh, tokenizer) -> TrainData:
    """The :class:`TrainData` of this rank of ``mesh``.

    Replica groups read disjoint parts of each global batch like more dp ranks, or, with
    ``data.replica_sources``, group g reads only its own source: its share of the batch
    (``global_batch / replicas``) split over the group's dp ranks.
    """
    data_cfg, train_cfg, micro = config.data, config.train, config.parallel.microbatches
    if not data_cfg.replica_sources:
        return TrainData(data_cfg, train_cfg, tokenizer,
                         dp_rank=mesh.replica_rank * mesh.dp + mesh.dp_rank,
                         dp_size=batch_readers(mesh.dp, mesh.replicas), microbatches=micro)
    own = dataclasses.replace(data_cfg, source=data_cfg.replica_sources[mesh.replica_rank],
                              replica_sources=[])
    share = dataclasses.replace(train_cfg, global_batch=train_cfg.global_batch // mesh.replicas)
    return TrainData(own, share, tokenizer, dp_rank=mesh.dp_rank, dp_size=mesh.dp,
                     microbatches=micro)
