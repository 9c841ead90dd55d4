"""Splitting an MoE layer's assignments over the tp ranks (the folded expert layout).

Under tensor parallelism the MoE layer is a replicated region: every tp rank holds the same
(gathered) tokens, routes them alike and sorts the same assignments by expert. With experts
folded over the tp ranks (:mod:`meshtrain.parallel.mesh`), each tp rank then takes **its own share
of the sorted rows** and dispatches only those over its expert group, so every assignment is
dispatched once and computed once in the whole stage; the expert outputs are all-gathered over tp
back into the full sorted order, where the replicated gate-and-sum continues.

The share of tp rank ``t`` of ``N`` rows is ``[t·C, min((t+1)·C, N))`` with ``C = ceil(N/tp)``
(the last shares may be shorter or empty). Both directions are autograd pairs:

- :func:`split_rows`: keep this rank's share forward; backward all-gathers the shares' gradients,
  so every tp rank gets the full (identical) gradient a replicated region must have;
- :func:`gather_rows`: all-gather the shares forward; backward keeps this rank's share of the
  (full, identical on every tp rank) gradient.

Each is one all-gather of ``tp · C`` rows (the shares padded to ``C``), counted on the ``tp``
axis: forward one, backward one, per MoE layer and micro-batch.
"""

from __future__ import annotations

import torch

from meshtrain.parallel.comm import CountedComm


def row_range(total: int, size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of tp rank ``rank``'s share of ``total`` sorted rows over ``size``."""
    chunk = -(-total // max(size, 1))
    return min(rank * chunk, total), min((rank + 1) * chunk, total)


def share_counts(counts: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows per expert inside ``[start, stop)`` of rows sorted by expert with ``counts[e]`` rows
    for expert ``e`` (LongTensor, stays on the device)."""
    ends = torch.cumsum(counts, 0)
    begins = ends - counts
    return (torch.minimum(ends, torch.full_like(ends, stop))
            - torch.maximum(begins, torch.full_like(begins, start))).clamp_min(0)


def _share(x: torch.Tensor, comm: CountedComm, rank: int, total: int) -> torch.Tensor:
    start, stop = row_range(total, comm.size, rank)
    return x[start:stop]


def _all_gather_shares(x: torch.Tensor, comm: CountedComm, rank: int,
                       total: int) -> torch.Tensor:
    chunk = -(-total // comm.size)
    if chunk == 0:
        return x.new_zeros((0, *x.shape[1:]))
    padded = x.new_zeros((chunk, *x.shape[1:]))
    padded[:x.shape[0]] = x
    out = x.new_empty((chunk * comm.size, *x.shape[1:]))
    comm.all_gather_into(out, padded)
    return out[:total]


class _RowPair(torch.autograd.Function):
    """``forward_op`` on the rows forward, ``backward_op`` on their gradient."""

    @staticmethod
    def forward(ctx, x, comm, rank, total, forward_op, backward_op):
        ctx.comm, ctx.rank, ctx.total, ctx.backward_op = comm, rank, total, backward_op
        return forward_op(x, comm, rank, total)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad.contiguous(), ctx.comm, ctx.rank, ctx.total), *[None] * 5


def split_rows(x: torch.Tensor, comm: CountedComm, rank: int) -> torch.Tensor:
    """This tp rank's share of the ``N`` rows of ``x`` (identical on every tp rank); backward
    all-gathers the shares' gradients."""
    if not comm.active:
        return x
    return _RowPair.apply(x, comm, rank, x.shape[0], _share, _all_gather_shares)


def gather_rows(share: torch.Tensor, comm: CountedComm, rank: int, total: int) -> torch.Tensor:
    """The ``total`` rows whose shares the tp ranks hold (``share`` is this rank's), in order;
    backward keeps this rank's share of the gradient."""
    if not comm.active:
        return share
    return _RowPair.apply(share, comm, rank, total, _all_gather_shares, _share)
