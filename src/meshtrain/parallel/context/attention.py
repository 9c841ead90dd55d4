"""Attention of this rank's query chunks against the whole sequence (all-gathered keys/values).

Each attention layer all-gathers the keys and values of every cp rank (after their projections
and rotary embedding), puts them in sequence order, and computes each local query chunk against
the keys up to that chunk's end (query ``i`` of chunk ``c`` sees keys ``0 .. c·L + i``): on the
CPU as two mask-free flash-attention blocks merged exactly
(:mod:`~meshtrain.parallel.context.blockwise`), elsewhere, and under document masking, as one
SDPA call with the mask. Backward reduce-scatters the keys' and values' gradients to their
owners. This is the all-gather variant of context parallelism that Llama 3's
training used: with grouped-query attention the keys and values are a fraction of the queries
(``n_kv_heads / n_heads``), so gathering them costs less than a ring of as many steps as ranks,
is one collective per tensor rather than ``cp - 1`` dependent exchanges, and supports any mask
(document masking) with no special case. A ring (keys passed around, online-softmax merge) would
hold only two key chunks at a time instead of the whole sequence's keys; see docs/parallelism.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.parallel.comm import CountedComm
from meshtrain.parallel.context.blockwise import blockwise_attention, blockwise_supported
from meshtrain.parallel.context.sequence import chunks_of_rank


class _GatherRanks(torch.autograd.Function):
    """``[B, H, s, D]`` per rank -> ``[cp, B, H, s, D]`` (every rank's); backward sums the
    gradient over ranks and keeps this rank's part (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        x = x.contiguous()
        out = torch.empty((comm.size * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        comm.all_gather_into(out, x)
        return out.view(comm.size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        shard = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        ctx.comm.reduce_scatter_into(shard, grad.flatten(0, 1))
        return shard, None


def gather_in_sequence_order(x: torch.Tensor, comm: CountedComm) -> torch.Tensor:
    """Every cp rank's ``x`` ``[B, H, 2L, D]`` (its two chunks) as the whole sequence
    ``[B, H, 2·cp·L, D]`` in sequence order."""
    cp = comm.size
    gathered = _GatherRanks.apply(x, comm)
    half = x.shape[2] // 2
    owner = {}
    for rank in range(cp):
        for slot, chunk in enumerate(chunks_of_rank(cp, rank)):
            owner[chunk] = (rank, slot)
    pieces = [gathered[r, :, :, s * half:(s + 1) * half] for r, s in
              (owner[c] for c in range(2 * cp))]
    return torch.cat(pieces, dim=2)


def _bottom_right_causal(rows: int, cols: int, device) -> torch.Tensor:
    """Mask ``[rows, cols]``: query ``i`` (the last ``rows`` positions) sees keys ``<= cols -
    rows + i``."""
    i = torch.arange(rows, device=device)[:, None]
    j = torch.arange(cols, device=device)[None, :]
    return j <= i + (cols - rows)


class ContextParallelAttention(nn.Module):
    """Replaces a block's parameter-free ``attention.core`` under context parallelism.

    Takes this rank's queries, keys and values ``[B, H, 2L, D]`` (its two chunks) and returns its
    queries' outputs; ``mask`` (document masking) is ``[B, 1, 2L, S]`` over the whole sequence's
    keys in sequence order, or None for causal attention."""

    def __init__(self, comm: CountedComm, rank: int):
        super().__init__()
        self.comm, self.rank = comm, rank
        self._masks: dict[tuple, torch.Tensor] = {}
        self.blockwise = True
        """Use mask-free blocks where :func:`blockwise_supported` (False: always the masked SDPA
        call, e.g. to compare the two)."""

    def _causal(self, rows: int, cols: int, device) -> torch.Tensor:
        key = (rows, cols, device)
        if key not in self._masks:
            self._masks[key] = _bottom_right_causal(rows, cols, device)
        return self._masks[key]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's attention output ``[B, Hq, 2L, D]``."""
        keys = gather_in_sequence_order(k, self.comm)
        values = gather_in_sequence_order(v, self.comm)
        half = q.shape[2] // 2
        gqa = q.shape[1] != k.shape[1]
        blockwise = mask is None and self.blockwise and blockwise_supported(q)
        outs = []
        for slot, chunk in enumerate(chunks_of_rank(self.comm.size, self.rank)):
            end = (chunk + 1) * half
            rows = slice(slot * half, (slot + 1) * half)
            if blockwise:
                start = chunk * half
                blocks = [(keys[:, :, :start], values[:, :, :start], False)] if start else []
                blocks.append((keys[:, :, start:end], values[:, :, start:end], True))
                outs.append(blockwise_attention(q[:, :, rows], blocks))
                continue
            if mask is None:
                chunk_mask = self._causal(half, end, q.device)
            else:
                chunk_mask = mask[:, :, rows, :end]
            outs.append(F.scaled_dot_product_attention(
                q[:, :, rows], keys[:, :, :end], values[:, :, :end], attn_mask=chunk_mask,
                enable_gqa=gqa))
        return torch.cat(outs, dim=2)
