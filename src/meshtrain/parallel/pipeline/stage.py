"""Cutting the model into its pipeline stages, and the per-stage forward.

Stage ``s`` of ``pp × virtual_stages`` holds a contiguous run of blocks (which ones:
:mod:`meshtrain.parallel.pipeline.stage_split`); the first stage also holds the embedding, the
last the final norm, the head (and computes the loss).

A rank keeps only the modules of its own stages: the others are deleted from the model (or set to
``None``), so parameter names stay those of the unsplit model and everything downstream (the
name-seeded init, data parallelism, checkpoints) works unchanged.

Tied embeddings (``model.tie_embeddings``): the head of the last stage is the embedding matrix,
so the last stage keeps ``tok_embeddings`` too (for its weight only; it reads hidden states). The
first and the last stage then each hold the matrix under its one name, get the same name-seeded
initial value, and sum their gradients over the mesh's ``tied`` group
(:meth:`~meshtrain.parallel.data.engine.DataParallelEngine.reduce_partial_grads`), so the copies
stay equal after every step.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.model.weight_grad import make_deferrable


class StageChunk:
    """The forward of one pipeline stage over the (shared) model's modules.

    Not an ``nn.Module``: the modules stay registered in the model under their usual names.
    """

    def __init__(self, model: nn.Module, stage: int, layers: list[int], is_first: bool,
                 is_last: bool):
        self.model, self.stage, self.layers = model, stage, layers
        self.is_first, self.is_last = is_first, is_last

    def __call__(self, x: torch.Tensor, layout=None) -> torch.Tensor:
        """Tokens (first stage) or hidden states in; hidden states or logits (last stage) out.
        ``layout``: the micro-batch's document layout (document masking), or None."""
        model = self.model
        h = model.tok_embeddings(x) if self.is_first else x
        for layer in self.layers:
            h = model.layers[str(layer)](h, layout)
        if self.is_last:
            h = model.head(model.norm(h))
        return h

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this stage's forward uses."""
        model = self.model
        modules = [model.layers[str(i)] for i in self.layers]
        if self.is_first:
            modules.append(model.tok_embeddings)
        if self.is_last:
            modules += [model.norm] + ([model.output] if model.output is not None else [])
            if model.tie_embeddings and not self.is_first:
                modules.append(model.tok_embeddings)  # the tied head's weight
        return [p for m in modules for p in m.parameters()]


def split_model(model: nn.Module, stages_here: list[int], layers_per_stage: list[list[int]],
                defer_weight_grads: bool = False) -> dict[int, StageChunk]:
    """Keep only this rank's stages in ``model`` (in place); return its chunks by stage.
    ``defer_weight_grads``: the schedule has ``W`` passes, so the matmuls get the deferrable
    backward (elsewhere they stay plain ``F.linear``, without its Python autograd step)."""
    last = len(layers_per_stage) - 1
    owned = {layer for s in stages_here for layer in layers_per_stage[s]}
    for key in list(model.layers.keys()):
        if int(key) not in owned:
            del model.layers[key]
    if 0 not in stages_here and not (model.tie_embeddings and last in stages_here):
        model.tok_embeddings = None
    if last not in stages_here:
        model.norm = None
        model.output = None
    if defer_weight_grads:
        make_deferrable(model)  # linear weight grads can wait for a W pass
    return {s: StageChunk(model, s, layers_per_stage[s], s == 0, s == last) for s in stages_here}
