"""Which tokens of every sequence a context-parallel rank holds (load-balanced causal chunks).

A sequence of ``S`` tokens is cut into ``2 × cp`` equal chunks; cp rank ``r`` holds chunks ``r``
and ``2cp - 1 - r``, one early and one late. Under a causal mask a query's work grows with its
position, so each rank gets the same work (chunk ``r`` attends to ``r + 1`` chunks of keys, chunk
``2cp - 1 - r`` to ``2cp - r``: ``2cp + 1`` chunk pairs on every rank), where a plain split into
``cp`` pieces would give the last rank ``2cp - 1`` times the first one's. The same split is used by
Megatron-Core and torchtitan for causal context parallelism.

A rank's tokens are its two chunks in that order; :func:`local_positions` are their places in the
whole sequence, which rotary embeddings use as positions and the attention uses for the mask.
"""

from __future__ import annotations

import torch

from meshtrain.config.layout_rules import context_parallel_fits
from meshtrain.model.sequence_layout import SequenceLayout


def chunks_of_rank(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 × cp``) that cp rank ``rank`` holds, in its order."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions in the whole sequence of the ``seq_len / cp`` tokens cp rank ``rank`` holds."""
    if not context_parallel_fits(seq_len, cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 × cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in chunks_of_rank(cp, rank)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """The part of ``x`` (whole sequences along ``dim``) that cp rank ``rank`` holds."""
    if cp == 1:
        return x
    if not context_parallel_fits(x.shape[dim], cp):
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by 2 × cp = {2 * cp}")
    chunk = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, c * chunk, chunk) for c in chunks_of_rank(cp, rank)], dim=dim)


def context_layout(full: SequenceLayout | None, seq_len: int, cp: int, rank: int,
                   device: torch.device | str = "cpu") -> SequenceLayout:
    """This rank's :class:`SequenceLayout` from the whole sequence's (``full``, computed from
    the whole micro-batch: document masking) or, without one, plain causal positions.

    The mask keeps the rows of this rank's queries and every key of the whole sequence, in the
    sequence's order (:class:`~meshtrain.parallel.context.attention.ContextParallelAttention`
    gathers the keys into that order)."""
    if full is None:
        return SequenceLayout(local_positions(seq_len, cp, rank, device), None, seq_len)
    positions = shard_sequence(full.positions, cp, rank, dim=full.positions.dim() - 1)
    return SequenceLayout(positions, shard_sequence(full.mask, cp, rank, dim=2), full.seq_len)
