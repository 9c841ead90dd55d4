"""Held-out evaluation: the mean token loss on data the run never trains on.

``train.eval_every = N`` evaluates after every N-th optimizer step and after the last one, on
``data.valid_source`` or on the tail that ``data.valid_fraction`` holds out of the training
source (:func:`meshtrain.data.packing.hold_out_tail`). Every evaluation reads the same
``train.eval_batches`` global batches: held-out sample ``i`` of batch ``b`` is sample
``(b × global_batch + i) mod n`` of the packed held-out stream, split over data-parallel ranks and
micro-batches exactly as a training step's batch is, so the sequences evaluated do not depend on
the layout.

What an evaluation does on every layout: forwards under ``torch.no_grad`` (no gradient, no
optimizer, no data-position change), through the same model and loss as training — the
vocab-parallel cross-entropy under tp, a forward-only schedule over the training schedule's stage
placement under pp (:func:`meshtrain.parallel.pipeline.schedules.forward_only`), ZeRO-3's
gather/free hooks (each block freed again after its forward). MoE layers route as in training
but leave the step's load statistics alone (so balancing and ``metrics.jsonl``'s ``moe`` are
untouched); the MoE aux loss is not part of ``eval_loss``. The result is ``eval_loss`` = summed
token cross-entropy over every evaluated target token divided by their number (all ranks), and
``eval_ppl`` = ``exp(eval_loss)``. With DiLoCo replica groups every group evaluates with its
own weights (on its own held-out tail under ``data.replica_sources``) and the token counts and
sums are added over the groups too.
"""

from __future__ import annotations

import math

import torch

from meshtrain.config import ConfigError
from meshtrain.data.packing import PackedDataset
from meshtrain.data.sampler import rank_microbatches
from meshtrain.data.sources import load_token_stream
from meshtrain.model import moe_layers
from meshtrain.parallel.pipeline.executor import PipelineExecutor
from meshtrain.parallel.pipeline.schedules import forward_only


def held_out_tokens(data_cfg, tokenizer, held_out, cache_dir=None):
    """The evaluation stream: ``data.valid_source`` tokenized like the training source, or the
    tail :class:`~meshtrain.data.train_data.TrainData` held out (``data.valid_fraction``); None
    when neither is set (a :class:`~meshtrain.data.shards.TokenShards`)."""
    if data_cfg.valid_source:
        import dataclasses

        valid = dataclasses.replace(data_cfg, source=data_cfg.valid_source, valid_source="",
                                    valid_fraction=0.0)
        return load_token_stream(valid, tokenizer, cache_dir)
    return held_out


class Evaluator:
    """Evaluates a :class:`~meshtrain.training.trainer.Trainer`'s model on held-out data."""

    def __init__(self, trainer, dataset: PackedDataset):
        self.trainer = trainer
        self.dataset = dataset
        config = trainer.config
        self.every = config.train.eval_every
        self.total_steps = config.train.steps
        self.batches = config.train.eval_batches
        self.global_batch = config.train.global_batch
        mesh = trainer.mesh
        self.dp_rank, self.dp = mesh.dp_rank, mesh.dp
        self.microbatches = config.parallel.microbatches
        self.pipeline = None
        if trainer.pipeline is not None:
            train_exec = trainer.pipeline
            self.pipeline = PipelineExecutor(
                forward_only(train_exec.schedule), train_exec.chunks, train_exec.comm,
                train_exec.pp_rank, train_exec.activation_shape, train_exec.dtype,
                train_exec.device, exchanger=train_exec.exchanger)
            self.pipeline.layout_fn = train_exec.layout_fn

    @classmethod
    def build(cls, trainer) -> Evaluator | None:
        """The evaluator ``train.eval_every`` asks for, or None when evaluation is off.

        Raises :class:`ConfigError` when the held-out data holds no complete sample."""
        config = trainer.config
        if not config.train.eval_every:
            return None
        tokens = held_out_tokens(config.data, trainer.tokenizer, trainer.data.held_out)
        dataset = PackedDataset(tokens, config.train.seq_len)
        if len(dataset) < 1:
            where = (f'data.valid_source "{config.data.valid_source}"' if config.data.valid_source
                     else f"data.valid_fraction = {config.data.valid_fraction}")
            raise ConfigError(f"{where} holds {len(tokens)} tokens, less than one sample of "
                              f"train.seq_len + 1 = {config.train.seq_len + 1}; hold out more "
                              "data or shorten train.seq_len.")
        return cls(trainer, dataset)

    def due(self, step: int) -> bool:
        """Whether the record of ``step`` (1-based, after its update) gets an evaluation."""
        return step % self.every == 0 or step == self.total_steps

    def local_microbatches(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of held-out batch ``batch`` (see the module docstring)."""
        n, first = len(self.dataset), batch * self.global_batch
        indices = [(first + i) % n for i in range(self.global_batch)]
        return [self.dataset.batch(micro) for micro in
                rank_microbatches(indices, self.dp_rank, self.dp, self.microbatches)]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """``{"eval_loss", "eval_ppl"}`` over ``train.eval_batches`` held-out batches (a
        collective: every rank calls it)."""
        trainer = self.trainer
        layers = moe_layers(trainer.model)
        for layer in layers:
            layer.record_step_stats = False
        loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
        tokens = 0
        try:
            for batch in range(self.batches):
                micro = trainer.local_targets(self.local_microbatches(batch))
                tokens += sum(int((y != trainer.ignore_index).sum()) for _, y in micro)
                loss_sum += self._batch_loss_sum(micro).double()
        finally:
            for layer in layers:
                layer.record_step_stats = True
        totals = torch.stack([loss_sum, torch.tensor(float(tokens), dtype=torch.float64,
                                                     device=trainer.device)])
        trainer.mesh.comm("dp_cp").all_reduce(totals)  # cp ranks: parts of every sequence
        if trainer.mesh.replicas > 1:  # every group's held-out tokens, each with its weights
            trainer.mesh.comm("replica").all_reduce(totals)
        loss = torch.stack([totals[0]])
        trainer.mesh.comm("pp").all_reduce(loss)  # the loss lives on the last stage
        mean = float(loss[0]) / max(float(totals[1]), 1.0)
        return {"eval_loss": mean, "eval_ppl": math.exp(min(mean, 700.0))}

    def _batch_loss_sum(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        trainer = self.trainer
        if self.pipeline is not None:
            return self.pipeline.run(micro, trainer.token_loss_sum)
        total = torch.zeros((), device=trainer.device)
        for inputs, targets in micro:
            inputs = inputs.to(trainer.device)
            logits = trainer.model(inputs, trainer.layout_of(inputs))
            total += trainer.token_loss_sum(logits, targets.to(trainer.device))
        return total
