"""Autograd-aware tensor-parallel collectives, all through the counted comm layer.

Megatron-LM's pair (Shoeybi et al. 2019):

- ``f`` = :func:`copy_to_tp_region`: identity forward, all-reduce backward (enter a TP region);
- ``g`` = :func:`reduce_from_tp_region`: all-reduce forward, identity backward (leave it).

and the sequence-parallel pair (Korthikanti et al. 2022), along the sequence dimension (dim 1 of
``[batch, seq, ...]``):

- :func:`gather_from_sequence_region`: all-gather forward, reduce-scatter backward;
- :func:`reduce_scatter_to_sequence_region`: reduce-scatter forward, all-gather backward.

and, for a module computed redundantly (replicated) on every tp rank under sequence parallelism
(the MoE layer, whose output is complete on every tp rank):

- :func:`gather_sequence_for_replicated`: all-gather forward, keep this rank's chunk backward
  (every rank's gradient is already the full one, so nothing is summed);
- :func:`scatter_to_sequence_region`: keep this rank's chunk forward, all-gather backward.
"""

from __future__ import annotations

import torch

from meshtrain.parallel.comm import CountedComm


def _all_gather_seq(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    """[B, S/t, ...] -> [B, S, ...]: gather sequence shards in tp-rank order."""
    local = x.transpose(0, 1).contiguous()
    out = torch.empty((local.shape[0] * comm.size, *local.shape[1:]), dtype=x.dtype,
                      device=x.device)
    comm.all_gather_into(out, local)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    """[B, S, ...] partial sums -> [B, S/t, ...] reduced shard of this tp rank."""
    full = x.transpose(0, 1).contiguous()
    if full.shape[0] % comm.size:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by tp={comm.size}")
    out = torch.empty((full.shape[0] // comm.size, *full.shape[1:]), dtype=x.dtype,
                      device=x.device)
    comm.reduce_scatter_into(out, full)
    return out.transpose(0, 1)


def _identity(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    return x.view_as(x)


def _all_reduce(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    x = x.contiguous().clone()
    comm.all_reduce(x)
    return x


def _my_chunk(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    chunk = x.shape[1] // comm.size
    rank = torch.distributed.get_group_rank(comm.group, torch.distributed.get_rank())
    return x[:, rank * chunk:(rank + 1) * chunk].contiguous()


class _ForwardBackwardPair(torch.autograd.Function):
    """``forward_op`` in forward, ``backward_op`` on the gradient: every function below is one
    such pair (e.g. Megatron's ``f`` = identity / all-reduce)."""

    @staticmethod
    def forward(ctx, x, comm, forward_op, backward_op):
        ctx.comm, ctx.backward_op = comm, backward_op
        return forward_op(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.comm), None, None, None


def _pair(x: torch.Tensor, comm: CountedComm, forward_op, backward_op) -> torch.Tensor:
    # An explicit graph break under train.compile (meshtrain.parallel.compile marks it): the
    # collectives run eagerly between the compiled pieces of a block.
    return _ForwardBackwardPair.apply(x, comm, forward_op, backward_op) if comm.active else x


def copy_to_tp_region(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    """Megatron ``f``: identity forward, all-reduce of the gradient backward."""
    return _pair(x, comm, _identity, _all_reduce)


def reduce_from_tp_region(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    """Megatron ``g``: all-reduce forward, identity backward."""
    return _pair(x, comm, _all_reduce, _identity)


def gather_from_sequence_region(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    """Sequence parallel: all-gather the sequence forward, reduce-scatter backward."""
    return _pair(x, comm, _all_gather_seq, _reduce_scatter_seq)


def reduce_scatter_to_sequence_region(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    """Sequence parallel: reduce-scatter over the sequence forward, all-gather backward."""
    return _pair(x, comm, _reduce_scatter_seq, _all_gather_seq)


def scatter_to_sequence_region(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    """Keep this rank's sequence chunk of a replicated tensor; all-gather backward."""
    return _pair(x, comm, _my_chunk, _all_gather_seq)


def gather_sequence_for_replicated(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    """All-gather the sequence forward; backward keeps this rank's chunk of the (full, identical
    on every tp rank) gradient. For modules computed redundantly on every tp rank."""
    return _pair(x, comm, _all_gather_seq, _my_chunk)
