"""The MoE auxiliary loss in the trainer's objective, and the global batch's expert loads.

**The objective.** Each MoE layer leaves its forward's auxiliary loss in ``last_stats``
(:mod:`meshtrain.model.moe`). Every scope normalises it like a mean over one micro-batch's tokens,
so the trainer adds, for each micro-batch, the sum over the layers divided by the number of
micro-batches of the step over all data-parallel ranks (:func:`scaled_aux_loss`); the gradient
summed over micro-batches and ranks is then that of the mean (``micro-batch``, ``sequence``) or of
the global-batch loss (``global-batch``). Under pipeline parallelism each stage adds its own
layers' term to the backward of its output (:func:`stage_aux_loss`).

**Global-batch loads** (``model.moe_balance_scope = "global-batch"`` with the aux loss): the
loss of micro-batch ``m`` is ``coef · E · Σ_i f_i · P_i(m)``, where ``f_i`` is expert ``i``'s share
of **every** assignment of the step (all micro-batches, all data- and context-parallel ranks) and
``P_i(m)`` the mean probability over ``m``'s tokens. Its gradient is linear in the probabilities
with coefficients ``f``, so the step's summed gradient is the global-batch loss's exactly — but
only if ``f`` is known when the first micro-batch's backward starts, before the later
micro-batches have been routed. A layer's routing depends on every earlier layer's output, so
``f`` cannot come from a cheaper computation than a forward; nor can the aux gradient be applied
later as a correction, because it flows through the router's input into every earlier layer
(a correction would need the Jacobian of every expert's probability sum with respect to every
parameter). :class:`GlobalBatchLoads` therefore:

* with **one micro-batch per rank and no pipeline**: lets each MoE layer sum its counts over the
  ``dp × cp`` ranks in its forward (:meth:`~meshtrain.model.moe.MoE.step_load`: one all-reduce
  of ``E`` int64 per MoE layer per step, counted in ``comm_bytes.dp``); the first forward is then
  the only one, so ``f`` is known before the aux loss is formed;
* otherwise (**several micro-batches, or pipeline stages**): runs a **routing pre-pass** before
  the step, a forward of every micro-batch without autograd (the pipeline's forward-only
  schedule under pp) in which each layer only tallies its assignments per expert, then one
  all-reduce over ``dp × cp`` of the ``[MoE layers of the stage, E]`` table (int64), and gives
  each layer its row as :attr:`~meshtrain.model.moe.MoE.global_load`. The step's forwards then
  route exactly as the pre-pass did (same weights, same tokens) and use ``f`` from the start.
  The price is one extra forward per micro-batch, about a third of a step's compute (a quarter
  with full activation checkpointing), which the planner adds to the step time.

Either way every layout and every micro-batch split gives the loss and gradients of one process
with one micro-batch, to fp32 rounding. The bias update of ``moe_balance = "bias"`` already uses
the global batch's load at the end of the step (:mod:`meshtrain.training.moe_stats`) and needs
neither.
"""

from __future__ import annotations

import torch

from meshtrain.model import moe_layers


def layer_aux_loss(layers) -> torch.Tensor | None:
    """The sum of ``layers``' last forward's aux losses (None when none has run)."""
    terms = [layer.last_stats["aux_loss"] for layer in layers if layer.last_stats]
    return torch.stack(terms).sum() if terms else None


def scaled_aux_loss(layers, microbatches: int, dp: int) -> torch.Tensor | None:
    """``layers``' aux losses of the micro-batch just run, as its share of the step's objective:
    divided by the step's ``microbatches × dp`` micro-batches (None without MoE layers)."""
    aux = layer_aux_loss(layers)
    return None if aux is None else aux / (microbatches * dp)


def stage_aux_loss(model, chunk, balance: str, microbatches: int,
                   dp: int) -> torch.Tensor | None:
    """A pipeline stage's (``chunk``'s layers of ``model``) aux losses of the micro-batch it
    just ran, scaled like :func:`scaled_aux_loss` (None without aux-loss balancing)."""
    if balance != "aux-loss":
        return None
    layers = [layer for i in chunk.layers for layer in moe_layers(model.layers[str(i)])]
    return scaled_aux_loss(layers, microbatches, dp) if layers else None


class GlobalBatchLoads:
    """Gives every MoE layer of this rank the step's global load before the step's first
    backward (see the module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.layers = moe_layers(trainer.model)
        self.comm = trainer.mesh.comm("dp_cp")
        self.prepass = trainer.pipeline is not None or trainer.plan.microbatches > 1
        self.executor = None
        if trainer.pipeline is not None:
            from meshtrain.parallel.pipeline.executor import PipelineExecutor
            from meshtrain.parallel.pipeline.schedules import forward_only

            pipe = trainer.pipeline
            self.executor = PipelineExecutor(
                forward_only(pipe.schedule), pipe.chunks, pipe.comm, pipe.pp_rank,
                pipe.activation_shape, pipe.dtype, pipe.device, exchanger=pipe.exchanger)
            self.executor.layout_fn = pipe.layout_fn
        if not self.prepass:
            for layer in self.layers:
                layer.batch_comm = self.comm

    @classmethod
    def build(cls, trainer) -> GlobalBatchLoads | None:
        """The helper when the run trains with a global-batch aux loss, else None."""
        model = trainer.config.model
        if (not model.moe_experts or model.moe_balance != "aux-loss"
                or model.moe_balance_scope != "global-batch"):
            return None
        return cls(trainer)

    def begin_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Forget the last step's loads; with a pre-pass, route ``microbatches`` (this rank's
        inputs and targets of the step) and set every layer's :attr:`global_load`. A
        collective over the stage's ``dp × cp`` ranks (and the pipeline's, with one)."""
        for layer in self.layers:
            layer.global_load = None
        if not self.prepass:
            return
        device = self.trainer.device
        for layer in self.layers:
            layer.load_tally = torch.zeros(layer.num_experts, dtype=torch.long, device=device)
            layer.record_step_stats = False
        try:
            self._route(microbatches)
        finally:
            for layer in self.layers:
                layer.record_step_stats = True
        if not self.layers:
            return
        table = torch.stack([layer.load_tally for layer in self.layers])
        for layer in self.layers:
            layer.load_tally = None
        self.comm.all_reduce(table)
        for layer, row in zip(self.layers, table, strict=True):
            layer.global_load = row

    @torch.no_grad()
    def _route(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Forward every micro-batch without autograd (the routing pre-pass)."""
        trainer = self.trainer
        if self.executor is not None:
            self.executor.run(microbatches, lambda logits, targets: logits.new_zeros(()))
            return
        for inputs, _ in microbatches:
            inputs = inputs.to(trainer.device)
            trainer.model(inputs, trainer.layout_of(inputs))
