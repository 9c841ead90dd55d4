"""Install context parallelism on a (possibly already tensor/expert/pipeline-split) model."""

from __future__ import annotations

from torch import nn

from meshtrain.model.moe import moe_layers
from meshtrain.parallel.comm import CountedComm
from meshtrain.parallel.context.attention import ContextParallelAttention
from meshtrain.parallel.context.sequence import shard_sequence


def apply_context_parallel(model: nn.Module, comm: CountedComm, rank: int) -> None:
    """Make ``model`` compute cp rank ``rank``'s part of every sequence.

    The model keeps taking whole sequences of tokens: its embedding (on the first pipeline stage)
    keeps this rank's chunks (:func:`~meshtrain.parallel.context.sequence.shard_sequence`), every
    block's attention core is replaced by
    :class:`~meshtrain.parallel.context.attention.ContextParallelAttention`, and MoE layers sum
    their aux-loss statistics over the cp ranks. The caller passes each forward this rank's
    :func:`~meshtrain.parallel.context.sequence.context_layout` (positions of its tokens) and
    compares its outputs with this rank's targets only.
    """
    cp = comm.size
    for block in model.layers.values():
        block.attention.core = ContextParallelAttention(comm, rank)
    for layer in moe_layers(model):
        layer.sequence_comm = comm
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings.register_forward_pre_hook(
            lambda _module, args: (shard_sequence(args[0], cp, rank), *args[1:]))
